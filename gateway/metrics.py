"""The gateway's Prometheus metrics, named as vLLM names its own (prefix pardec_ for vllm:).

Speculative decoding: ``pardec_spec_decode_num_drafts_total`` (steps that carried a tree),
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and the gauge
``pardec_spec_decode_mean_acceptance_length`` (1 + accepted / drafts, vLLM's definition).
Requests: ``pardec_requests_total{method,status}``, ``pardec_requests_running``,
``pardec_time_to_first_token_seconds``, ``pardec_e2e_request_latency_seconds``, and of each finished
request ``pardec_request_success_total{finished_reason}``, ``pardec_request_prompt_tokens``,
``pardec_request_generation_tokens``, ``pardec_request_time_per_output_token_seconds``,
``pardec_request_decode_time_seconds``; between a request's commits
``pardec_inter_token_latency_seconds``; steps:
``pardec_decode_steps_total``, ``pardec_step_duration_seconds``; fallbacks:
``pardec_drafter_fallbacks_total{reason}``, ``pardec_verifier_failovers_total{reason}`` (sessions
moved to another verifier replica); the load governor (gateway/governor.py), by load band:
``pardec_load_governor_drafting{band}`` (1 while sessions may draft), and per epoch
``pardec_load_governor_epochs_total{band,arm}``, ``pardec_load_governor_tokens_per_second{band,arm}``
(the throughput the last epoch of that arm measured) and ``pardec_load_governor_gain{band}`` (the
median draft/plain throughput ratio of adjacent epochs).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pardec.runtime.metrics import LATENCY_BUCKETS, RequestMetrics, new_registry

# A token's time: from a fraction of a millisecond (a 135M model on a GPU, several tokens a step)
# to seconds (a big model on a loaded CPU).
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                         0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
# Tokens a request: 1, 2, 5, 10, 20, 50, ... (vLLM's 1-2-5 series), past any model's context.
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
# OpenAI's finish reasons, as vLLM's request_success_total labels them; pardec's "eos" is a stop.
FINISHED_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or new_registry()
        r = self.registry
        self.requests = RequestMetrics(r, "pardec")
        self.running = Gauge("pardec_requests_running", "Requests being generated now", registry=r)
        self.ttft = Histogram(
            "pardec_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "pardec_e2e_request_latency_seconds", "Whole generation, first byte in to last token out",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("pardec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pardec_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter("pardec_decode_steps", "Verifier steps (prefill excluded)", registry=r)
        self.success = Counter(
            "pardec_request_success", "Sequences (a request's n, its beams) answered whole, by finish reason (stop, "
            "length)", ("finished_reason",), registry=r,
        )
        for reason in sorted(set(FINISHED_REASONS.values())):  # each series from 0, so that rate() sees the first
            self.success.labels(reason)
        self.request_prompt_tokens = Histogram(
            "pardec_request_prompt_tokens", "Prompt tokens a finished request", buckets=TOKEN_COUNT_BUCKETS, registry=r,
        )
        self.request_generation_tokens = Histogram(
            "pardec_request_generation_tokens", "Tokens a finished request generated", buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "pardec_inter_token_latency_seconds", "Time between a request's successive commits (a drafted step "
            "commits several tokens at once)", buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.time_per_output_token = Histogram(
            "pardec_request_time_per_output_token_seconds", "A finished request's time per token after its first",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.decode_time = Histogram(
            "pardec_request_decode_time_seconds", "A finished request's time from its first token to its last",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.prediction_tokens = Counter(
            "pardec_prediction_tokens", "Tokens of requests' predictions (OpenAI's Predicted Outputs), by whether "
            "they appeared in the answer", ("outcome",), registry=r,
        )
        self.step_duration = Histogram(
            "pardec_step_duration_seconds", "Verify call wall time as seen by the gateway",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.drafts = Counter("pardec_spec_decode_num_drafts", "Steps that carried a draft tree", registry=r)
        self.draft_tokens = Counter("pardec_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter(
            "pardec_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.mean_acceptance = Gauge(
            "pardec_spec_decode_mean_acceptance_length",
            "Tokens committed per drafted step, 1 + accepted / drafts (0 before any draft)", registry=r,
        )
        self._lock = threading.Lock()
        self._drafted = self._accepted = 0  # the gauge's inputs, kept apart from the counters' internals
        self.mean_acceptance.set_function(self._mean_acceptance)
        self.fallbacks = Counter(
            "pardec_drafter_fallbacks", "Steps or requests that fell back to plain decoding, by reason",
            ("reason",), registry=r,
        )
        self.failovers = Counter(
            "pardec_verifier_failovers", "Sessions resumed on another verifier replica, by reason", ("reason",),
            registry=r,
        )

        self.governor_drafting = Gauge(
            "pardec_load_governor_drafting", "1 while the load governor lets sessions draft, by load band",
            ("band",), registry=r,
        )
        self.governor_epochs = Counter(
            "pardec_load_governor_epochs", "Load governor epochs run, by load band and arm", ("band", "arm"),
            registry=r,
        )
        self.governor_rate = Gauge(
            "pardec_load_governor_tokens_per_second", "Throughput of the last epoch of each arm, by load band",
            ("band", "arm"), registry=r,
        )
        self.governor_gain = Gauge(
            "pardec_load_governor_gain", "Median draft/plain throughput ratio of adjacent epochs, by load band",
            ("band",), registry=r,
        )

    def governor_epoch(self, band: str, drafted: bool, tokens_per_s: float, gain: float, drafting_next: bool) -> None:
        arm = "draft" if drafted else "plain"
        self.governor_epochs.labels(band, arm).inc()
        self.governor_rate.labels(band, arm).set(tokens_per_s)
        self.governor_gain.labels(band).set(gain)
        self.governor_drafting.labels(band).set(1 if drafting_next else 0)

    def step(self, draft_tokens: int, accepted: int, seconds: float, since_commit_s: float | None = None) -> None:
        """A verify step: its tree's draft tokens, those accepted, the verify call's time, and the
        time since the request's previous commit (its inter-token latency)."""
        self.steps.inc()
        self.step_duration.observe(seconds)
        if since_commit_s is not None:
            self.inter_token_latency.observe(since_commit_s)
        if draft_tokens:
            with self._lock:
                self._drafted += 1
                self._accepted += accepted
            self.drafts.inc()
            self.draft_tokens.inc(draft_tokens)
            self.accepted_tokens.inc(accepted)

    def count_finish(self, finish_reason: str) -> None:
        self.success.labels(FINISHED_REASONS.get(finish_reason, finish_reason)).inc()

    def finished(self, stats, generated_tokens: int, finish_reason: str = "", decoded: bool = True) -> None:
        """A request's figures once it has ended; ``decoded`` False: its tokens were not sent as
        they came (beam search), so it has no decode time nor time per token."""
        self.latency.observe(stats.total_ms / 1e3)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.request_prompt_tokens.observe(stats.prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        if finish_reason:
            self.count_finish(finish_reason)
        if not decoded:
            return
        decode_s = max(0.0, stats.total_ms - stats.ttft_ms) / 1e3
        self.decode_time.observe(decode_s)
        if generated_tokens > 1:
            self.time_per_output_token.observe(decode_s / (generated_tokens - 1))
        if stats.prediction_tokens:
            self.prediction_tokens.labels("accepted").inc(stats.accepted_prediction_tokens)
            self.prediction_tokens.labels("rejected").inc(stats.rejected_prediction_tokens)

    def drafter_fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason).inc()

    def verifier_failover(self, reason: str) -> None:
        self.failovers.labels(reason).inc()

    def _mean_acceptance(self) -> float:
        with self._lock:
            return 1.0 + self._accepted / self._drafted if self._drafted else 0.0
