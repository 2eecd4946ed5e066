"""A fake engine whose KV events lose one batch (its number is skipped), as events dropped on
the way would look to the coordinator. Run as a script:

    python tests/integration/gappy_engine.py COORDINATOR_ADDRESS RANK LOSE_BATCH
"""

from __future__ import annotations

import sys

from dpserve.engine.connection import EngineConnection
from dpserve.engine.fake import FakeRunner
from dpserve.engine.fake_cache import SimulatedPrefixCache
from dpserve.engine.server import EngineServer
from dpserve.protocol import KvEvents


def main(address: str, rank: str, lose_batch: str) -> int:
    runner = FakeRunner(step_delay=0.01, prefix_cache=SimulatedPrefixCache(4096, 16))
    connection = EngineConnection(address, int(rank), runner.max_num_seqs)
    server = EngineServer(connection, runner)
    publisher = server._kv_publisher
    assert publisher is not None
    lose = int(lose_batch)
    numbered = publisher._batch

    def losing(events: list) -> KvEvents:  # type: ignore[type-arg]
        batch = numbered(events)
        if batch.number == lose:  # never sent: the next one arrives after a gap
            return numbered(events)
        return batch

    publisher._batch = losing  # type: ignore[method-assign]
    return server.run()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
