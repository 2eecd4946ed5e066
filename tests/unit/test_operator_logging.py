"""The operator's log: the kubelet's liveness probes do not fill it."""

from __future__ import annotations

import logging

import pytest

from dpserve_operator.handlers import ACCESS_LOGGER, QuietLivenessProbes


def access_record(request_line: str, status: int) -> logging.LogRecord:
    """A record as aiohttp's access logger makes it (its fields go in ``extra``)."""
    record = logging.getLogger(ACCESS_LOGGER).makeRecord(
        ACCESS_LOGGER, logging.INFO, __file__, 1, f'10.244.0.1 "{request_line}" {status} 2', (),
        None, extra={"first_request_line": request_line, "response_status": status},
    )  # fmt: skip
    return record


@pytest.mark.parametrize(
    ("request_line", "status", "kept"),
    [
        ("GET /healthz HTTP/1.1", 200, False),
        ("GET /healthz?verbose=1 HTTP/1.1", 200, False),
        ("GET /healthz HTTP/1.1", 500, True),  # a failing probe is worth a line
        ("GET /metrics HTTP/1.1", 200, True),
        ("", 400, True),
    ],
)
def test_answered_liveness_probes_are_not_logged(
    request_line: str, status: int, kept: bool
) -> None:
    assert QuietLivenessProbes().filter(access_record(request_line, status)) is kept


def test_an_unrelated_record_is_kept() -> None:
    record = logging.makeLogRecord({"msg": "GET /healthz", "levelno": logging.INFO})
    assert QuietLivenessProbes().filter(record) is True
