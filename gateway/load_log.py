"""A log line of the gateway's load every ``interval_s`` while it works (vLLM logs its engine's
stats alike, by default): requests running and finished, the tokens decode steps committed and
what parallel decoding did, from the gateway's Prometheus counters (gateway/metrics.py). An idle interval (nothing running,
nothing counted) writes nothing.

    >>> before = {"pardec_prompt_tokens_total": 100.0, "pardec_generation_tokens_total": 40.0}
    >>> after = {"pardec_requests_running": 2.0, "pardec_e2e_request_latency_seconds_count": 3.0,
    ...          "pardec_prompt_tokens_total": 900.0, "pardec_generation_tokens_total": 340.0,
    ...          "pardec_decode_steps_total": 120.0, "pardec_spec_decode_num_drafts_total": 100.0,
    ...          "pardec_spec_decode_num_draft_tokens_total": 800.0,
    ...          "pardec_spec_decode_num_accepted_tokens_total": 180.0, "pardec_drafter_fallbacks_total": 2.0}
    >>> print(load_line(before, after, 10.0))
    load: 2 running; last 10 s: 3 finished (800 prompt tokens, 300 generated); 120 steps committed 300 tokens (30.0 tokens/s), 100 drafted: 2.80 tokens per drafted step, 22.5% of 800 draft tokens accepted; 2 plain fallbacks
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

log = logging.getLogger("pardec.gateway.load")


def totals(registry) -> dict[str, float]:
    """Each sample's value summed over its labels, by sample name (``pardec_..._total``,
    ``..._count``, gauges); the requests that failed or were refused apart, as
    ``pardec_requests_failed``."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "pardec_requests_total" and sample.labels.get("status") != "OK":
                out["pardec_requests_failed"] = out.get("pardec_requests_failed", 0.0) + sample.value
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def load_line(before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> str:
    """The line of what happened between two ``totals``, ``seconds`` apart: the requests that
    finished (their prompts' and answers' tokens), and the decode steps run and the tokens they
    committed, each step its accepted draft tokens and one of the model's own."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    seconds = max(seconds, 1e-9)
    finished = delta("pardec_e2e_request_latency_seconds_count")
    parts = [f"load: {after.get('pardec_requests_running', 0):.0f} running; last {seconds:.3g} s: {finished:.0f} "
             f"finished ({delta('pardec_prompt_tokens_total'):.0f} prompt tokens, "
             f"{delta('pardec_generation_tokens_total'):.0f} generated)"]
    if delta("pardec_requests_failed"):
        parts[0] += f", {delta('pardec_requests_failed'):.0f} failed or refused"
    steps, drafts = delta("pardec_decode_steps_total"), delta("pardec_spec_decode_num_drafts_total")
    draft_tokens, accepted = (delta(f"pardec_spec_decode_num_{kind}_tokens_total") for kind in ("draft", "accepted"))
    if steps:
        committed = steps + accepted
        line = f"{steps:.0f} steps committed {committed:.0f} tokens ({committed / seconds:.1f} tokens/s)"
        if drafts:
            line += (f", {drafts:.0f} drafted: {1 + accepted / drafts:.2f} tokens per drafted step, "
                     f"{100 * accepted / max(draft_tokens, 1):.1f}% of {draft_tokens:.0f} draft tokens accepted")
        parts.append(line)
    if delta("pardec_drafter_fallbacks_total"):
        parts.append(f"{delta('pardec_drafter_fallbacks_total'):.0f} plain fallbacks")
    return "; ".join(parts)


def _changed(before: Mapping[str, float], after: Mapping[str, float]) -> bool:
    """Whether any count moved (a request, a step, a token)."""
    return any(after.get(name) != before.get(name) for name in {*before, *after}
               if name.endswith(("_total", "_count")) or name == "pardec_requests_failed")


class LoadLog:
    """Logs ``load_line`` of ``registry``'s counters every ``interval_s`` in which requests ran or
    anything was counted, from a thread of its own until ``stop`` or while ``alive()``."""

    def __init__(self, registry, interval_s: float, alive: Callable[[], bool] = lambda: True):
        self._registry, self.interval_s, self._alive = registry, interval_s, alive
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        before, since = totals(self._registry), time.monotonic()
        while not self._stopped.wait(self.interval_s) and self._alive():
            after, now = totals(self._registry), time.monotonic()
            if after.get("pardec_requests_running") or _changed(before, after):
                log.info("%s", load_line(before, after, now - since))
            before, since = after, now

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5.0)
