"""A fake engine process that dies, as a sampler fed inf/nan logits would, in the first step
that holds a request whose prompt contains ``POISON``. Run as a script:

    python tests/integration/poison_engine.py COORDINATOR_ADDRESS RANK STEP_DELAY
"""

from __future__ import annotations

import os
import sys

from dpserve.engine.connection import EngineConnection
from dpserve.engine.fake import FakeRunner
from dpserve.engine.runner import RunnerRequest, TokenUpdate
from dpserve.engine.server import EngineServer

POISON = b"POISON"
EXIT_CODE = 13


class PoisonedRunner(FakeRunner):
    def __init__(self, step_delay: float) -> None:
        super().__init__(step_delay=step_delay)
        self.poisoned = False

    def add(self, request: RunnerRequest) -> None:
        super().add(request)
        self.poisoned = self.poisoned or POISON in bytes(request.prompt_tokens)

    def step(self) -> list[TokenUpdate]:
        if self.poisoned:
            os._exit(EXIT_CODE)  # no cleanup, no goodbye: as a crashed process
        return super().step()


def main(address: str, rank: str, step_delay: str) -> int:
    runner = PoisonedRunner(float(step_delay))
    connection = EngineConnection(address, int(rank), runner.max_num_seqs)
    return EngineServer(connection, runner).run()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
