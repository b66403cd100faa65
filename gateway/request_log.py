"""What the gateway says of each request once it ends: its trace span, where a collector is
configured (runtime/tracing.py), and, with ``log_requests`` (vLLM's ``--enable-log-requests``), one
log line. Both carry the request's id: the caller's ``X-Request-Id`` (HTTP header or gRPC
metadata), else a new one. The line says how the text was made and what it cost, never the
prompt's or the answer's text:

    >>> print(request_line("req-7", "acme", {"gen_ai.usage.prompt_tokens": 128, "pardec.cached_prompt_tokens": 96,
    ...     "gen_ai.usage.completion_tokens": 64, "pardec.decoding_method": "memory_decoding", "pardec.steps": 12,
    ...     "pardec.mean_accepted_length": 5.33, "gen_ai.latency.time_to_first_token": 0.045,
    ...     "gen_ai.latency.e2e": 0.82}))
    request id=req-7 tenant=acme status=OK prompt_tokens=128 cached_tokens=96 completion_tokens=64 method=memory_decoding steps=12 tokens_per_step=5.33 ttft_ms=45 e2e_ms=820
    >>> from pardec.runtime.errors import InvalidArgument
    >>> print(request_line("req-8", "", {}, InvalidArgument("max_tokens: must be >= 1")))
    request id=req-8 status=INVALID_ARGUMENT error="max_tokens: must be >= 1"

A value that is not a plain word (a caller's id may hold any visible character) is quoted, so no
caller can write a field of its own into the line:

    >>> print(request_line("status=OK", "", {}, InvalidArgument("no")))
    request id="status=OK" status=INVALID_ARGUMENT error="no"
"""

from __future__ import annotations

import json
import logging
import re
from typing import Mapping

from pardec.runtime.errors import PardecError, Unauthenticated
from pardec.runtime.tracing import NO_SPAN, RequestSpan, Tracer

log = logging.getLogger("pardec.gateway.requests")

# The span's attributes a log line shows, under shorter names.
_SHOWN = (("gen_ai.usage.prompt_tokens", "prompt_tokens"), ("pardec.cached_prompt_tokens", "cached_tokens"),
          ("gen_ai.usage.completion_tokens", "completion_tokens"), ("pardec.decoding_method", "method"),
          ("pardec.steps", "steps"), ("pardec.mean_accepted_length", "tokens_per_step"),
          ("gen_ai.latency.time_to_first_token", "ttft_ms"), ("gen_ai.latency.e2e", "e2e_ms"))
_SHOWN_IF_SET = ("pardec.cached_prompt_tokens", "gen_ai.latency.time_to_first_token")  # 0: none (no first token)
_MAX_ERROR = 200  # characters of an error's message in its line
_PLAIN = re.compile(r"[A-Za-z0-9._:/@+-]+")


def _word(value: str) -> str:
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


def status_of(error: BaseException | None) -> str:
    """The gRPC status name a request ended with (a consumer that went away: CANCELLED)."""
    if error is None:
        return "OK"
    if isinstance(error, PardecError):
        return error.status.name
    return "CANCELLED" if isinstance(error, GeneratorExit) else "INTERNAL"


def request_line(request_id: str, tenant: str, attributes: Mapping[str, object],
                 error: BaseException | None = None, sequence: int | None = None) -> str:
    """One request's log line from its span's attributes (``sequence``: which of its sequences)."""
    parts = [f"request id={_word(request_id)}"] + ([f"sequence={sequence}"] if sequence is not None else [])
    parts += [f"tenant={_word(tenant)}"] if tenant else []
    parts.append(f"status={status_of(error)}")
    for key, name in _SHOWN:
        value = attributes.get(key)
        if value is None or (key in _SHOWN_IF_SET and not value):
            continue
        if name.endswith("_ms"):
            value = round(float(value) * 1e3)
        elif isinstance(value, float):
            value = f"{value:.2f}"
        parts.append(f"{name}={value}")
    if error is not None:
        parts.append(f"error={json.dumps(str(error)[:_MAX_ERROR])}")
    return " ".join(parts)


class RequestReport:
    """One sequence's report: ``current`` around its internal calls (their spans are its
    children), ``end`` (once) with what it did."""

    def __init__(self, span: RequestSpan, request_id: str, tenant: str, logged: bool, sequence: int | None = None):
        self._span, self._request_id, self._tenant, self._logged = span, request_id, tenant, logged
        self._sequence = sequence

    def current(self):
        return self._span.current()

    def end(self, attributes: Mapping[str, object], error: BaseException | None = None,
            ended_ns: int | None = None) -> None:
        self._span.end({"gen_ai.request.id": self._request_id, "pardec.sequence": self._sequence, **attributes},
                       error, ended_ns)
        if self._logged:
            self._logged = False
            log.info("%s", request_line(self._request_id, self._tenant, attributes, error, self._sequence))


class RequestReports:
    """Where requests' reports go: ``tracer``'s spans (None: no spans), log lines with ``logged``."""

    def __init__(self, tracer: Tracer | None, logged: bool):
        self.tracer, self.logged = tracer, logged

    @classmethod
    def serving(cls, otlp_traces_endpoint: str, logged: bool) -> "RequestReports":
        """The gateway's: spans to ``otlp_traces_endpoint`` ("": none), log lines if ``logged``."""
        return cls(Tracer("pardec-gateway", otlp_traces_endpoint) if otlp_traces_endpoint else None, logged)

    def begin(self, deadline, tenant: str = "", sequence: int | None = None) -> RequestReport:
        """A report of a request under ``deadline`` (gateway/deadlines.py), begun at its arrival;
        ``sequence``: which of its sequences, where it has several."""
        deadline.reported = True
        span = self.tracer.request(deadline.trace, deadline.arrived_ns) if self.tracer else NO_SPAN
        return RequestReport(span, deadline.request_id, tenant, self.logged, sequence)

    def refused(self, deadline, tenant: str, error: BaseException) -> None:
        """Reports ``error`` of a request that a front refused before any report of it began (the
        generator reports its own refusals and failures); not one refused for its token, which
        anyone could send without end (the metrics count it)."""
        if not deadline.reported and not isinstance(error, Unauthenticated):
            self.begin(deadline, tenant).end({}, error)

    def refusals(self, deadline) -> "Refusals":
        """A block whose error ``refused`` reports; its ``tenant``, once known, goes with it."""
        return Refusals(self, deadline)


class Refusals:
    def __init__(self, reports: RequestReports, deadline):
        self._reports, self._deadline, self.tenant = reports, deadline, ""

    def __enter__(self) -> "Refusals":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, Exception):
            self._reports.refused(self._deadline, self.tenant, error)
        return False
