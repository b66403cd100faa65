"""How the gateway's HTTP API answers an error: the errors of the exchange itself (a body too
large or too slow), a core error as an HTTP response in the API's own shape (OpenAI's error
JSON by default, `ErrorShape`), and the counting of each request under its status."""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from pardec.gateway.openai_api import http_field
from pardec.gateway.deadlines import DeadlineExceeded
from pardec.runtime.errors import InvalidArgument, PardecError, ResourceExhausted, Unauthenticated

log = logging.getLogger(__name__)


# gRPC status name -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


def error_body(error: PardecError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI's error JSON) of a core error."""
    status, kind = HTTP_STATUS.get(error.status.name, (500, "server_error"))
    param, message = http_field(str(error)) if status < 500 or status in (503, 504) else ("", str(error))
    return status, {"error": {"message": message, "type": kind, "param": param or None, "code": error.status.name}}


class BodyTooLarge(ResourceExhausted):
    """A body over the gateway's message limit: RESOURCE_EXHAUSTED as on the gRPC port, and
    HTTP's own 413 rather than the 429 of a busy server, which a client would retry."""


class BodyTimeout(DeadlineExceeded):
    """A body not received whole in time: HTTP's own 408."""


class NotJson(InvalidArgument):
    """A body sent as another media type than JSON: HTTP's own 415, as vLLM's and TGI's servers
    answer it. A page of any site may post a form or text/plain body to a server on the user's
    machine without asking (no CORS preflight), never a JSON one."""


_EXCHANGE_STATUS = ((BodyTooLarge, 413), (BodyTimeout, 408), (NotJson, 415))


def exchange_status(error: PardecError, status: int) -> int:
    """The HTTP status of an error of the exchange itself (its body), else ``status``."""
    for kind, own in _EXCHANGE_STATUS:
        if isinstance(error, kind):
            return own
    return status


def json_media_type(value: str) -> bool:
    """Whether a Content-Type names JSON: application/json or application/*+json, any parameters.

    >>> json_media_type("application/json; charset=utf-8"), json_media_type("application/vnd.api+json")
    (True, True)
    >>> json_media_type("text/plain;charset=UTF-8"), json_media_type("application/x-www-form-urlencoded")
    (False, False)
    """
    kind = value.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class ErrorShape:
    """An API's error: its HTTP status and JSON body. OpenAI's here; an API of another shape
    (TGI's) overrides `body`."""

    def body(self, error: PardecError) -> tuple[int, dict[str, Any]]:
        status, body = error_body(error)
        own = exchange_status(error, status)
        if own != status:
            status, body["error"]["type"] = own, "timeout" if own == 408 else "invalid_request_error"
        return status, body

    def response(self, error: PardecError) -> JSONResponse:
        status, body = self.body(error)
        # A body may be left unread: closing spares uvicorn reading (and dropping) what still comes.
        closes = isinstance(error, (BodyTooLarge, BodyTimeout, NotJson, Unauthenticated))
        return JSONResponse(body, status_code=status, headers={"connection": "close"} if closes else None)

    def event(self, error: PardecError) -> tuple[dict[str, Any], str | None]:
        """An error after a stream began: (the event's data, its event name)."""
        return self.body(error)[1], "error"


OPENAI = ErrorShape()


class Counted:
    """Counts the block as one request of ``method`` (runtime/metrics.py RequestMetrics), and keeps
    a core error (``.error``) instead of raising it, for its response (``.response``)."""

    def __init__(self, requests, method: str, shape: ErrorShape = OPENAI):
        self._tracking = requests.track(method)
        self._shape = shape
        self.error: PardecError | None = None

    @property
    def response(self) -> JSONResponse | None:
        # An error after a stream began was already sent as an event: nothing more to answer.
        if self.error is None or isinstance(self.error, AfterStart):
            return None
        return self._shape.response(self.error)

    def __enter__(self) -> "Counted":
        self._tracking.__enter__()
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self._tracking.__exit__(kind, error, traceback)  # counts it: its status, or INTERNAL
        if isinstance(error, Exception):
            self.error = error if isinstance(error, PardecError) else internal(error)
            return True
        return False


def internal(error: Exception) -> PardecError:
    """An unexpected error as the INTERNAL error a client gets, logged with its traceback."""
    log.error("HTTP API: unexpected %s", type(error).__name__, exc_info=error)
    return PardecError(f"internal error ({type(error).__name__}); the gateway's log has the details")


class AfterStart(PardecError):
    """A core error that ended a stream whose headers were sent: counted under its own status."""

    def __init__(self, error: PardecError):
        super().__init__(str(error))
        self.status = error.status
