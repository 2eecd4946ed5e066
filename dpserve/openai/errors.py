"""Errors as OpenAI shapes them: ``{"error": {message, type, param, code}}`` with a status."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from dpserve.client import ClientError, RequestFailed
from dpserve.protocol import ErrorCode


class InvalidRequest(ValueError):
    """A request this server will not run; becomes an OpenAI-style error body."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def error_body(
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ErrorCode of a RequestFailed -> HTTP status. Unlisted codes are our own bugs: 500.
_FAILURE_STATUS: dict[str, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.NO_ENGINE: 503,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.STOPPED: 503,
    ErrorCode.CANCELLED: 503,
    ErrorCode.ENGINE_ERROR: 502,
}


def failure_status(code: str) -> int:
    return _FAILURE_STATUS.get(code, 500)


def error_type_for_status(status: int) -> str:
    if status < 500:
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable_error"
    if status == 504:
        return "timeout_error"
    return "server_error"


def outcome_for_status(status: int) -> str:
    """The ``outcome`` label of ``dpserve_http_requests_total`` for a response status."""
    if status < 400:
        return "success"
    if status < 500:
        return "invalid_request"
    return {502: "engine_error", 503: "unavailable", 504: "timeout"}.get(status, "error")


@dataclasses.dataclass(frozen=True, slots=True)
class HttpError:
    """An error as status, OpenAI-style body and headers: sent as a JSON response, or as an
    SSE event when a stream has already started."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] | None = None

    @classmethod
    def of(
        cls,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> HttpError:
        return cls(status, error_body(message, error_type_for_status(status), param, code), headers)

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


def invalid_request_error(exc: InvalidRequest) -> HttpError:
    return HttpError.of(exc.status, exc.message, param=exc.param, code=exc.code)


def request_failed_error(exc: RequestFailed) -> HttpError:
    """A coordinator's or engine's refusal, with the status its code maps to."""
    status = failure_status(exc.code)
    return HttpError.of(
        status,
        exc.message,
        param="prompt" if exc.code == ErrorCode.PROMPT_TOO_LONG else None,
        code=exc.code,
        headers={"Retry-After": "1"} if status == 503 else None,
    )


def unavailable_error(exc: ClientError) -> HttpError:
    return HttpError.of(503, f"the coordinator client is unavailable: {exc}", code="unavailable")


def timeout_error(seconds: float) -> HttpError:
    return HttpError.of(504, f"the request did not finish within {seconds:g} s", code="timeout")
