"""The gateway's configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pardec.drafter.config import DrafterConfig
from pardec.gateway.draft_ahead import OVERLAP_CHOICES
from pardec.gateway.http_options import HttpOptions
from pardec.gateway.rules import CONFIG, Facts, check
from pardec.runtime.draft_params import PLUGIN_TYPES, DraftParams
from pardec.runtime.errors import ConfigError
from pardec.runtime.limits import DEFAULT_MAX_CONCURRENT_RPCS, PUBLIC_MAX_MESSAGE_BYTES, check_limits
from pardec.runtime.security import BearerTokens, ClientTLS, ServerTLS
from pardec.runtime.tracing import check_endpoint

# DraftParams (MindIE's plugin_params) lives with the parameter table, runtime/draft_params.py,
# which the drafter reads too; config.json's plugin_params are checked by the rules table.
__all__ = ["PLUGIN_TYPES", "DraftParams", "GatewayConfig", "LoadPolicy"]


@dataclass(frozen=True)
class LoadPolicy:
    """How each step's tree is sized (gateway/tree_sizing.py): the prefix of the drafter's
    best-first tree that maximizes the session's expected tokens per second, from the drafter's
    acceptance estimates calibrated on what the session actually accepted, and the verifier's
    measured step cost (ModelInfo.cost_curve) at the current number of requests in flight.
    decoding_length (or lookahead's (N-1)(W+G)) stays the upper bound. As load grows each row
    costs more, and trees shrink on their own down to plain steps where drafts do not pay.

    The knobs: ``plain_from``, the hard switch: from this many requests in flight every step
    runs plain (0 = off: the cost model and the governor decide at any load). Its default, 16,
    is where drafting stopped paying on the project's CPUs of few cores whatever the trees: with
    the verifier saturated, every row and every drafter call is taken from other sessions, and
    measured through the stack, 16 and 32 requests ran below plain throughput even with drafting
    governed (docs/benchmarks.md, "Figures behind design choices" and "AVX-512: under load").
    vLLM's ``speculative_disable_by_batch_size`` is the same switch. An accelerator, where a
    forward's extra rows cost little more at batch 16, may raise or turn it off; ``step_overhead_ms``,
    the first guess of what a step costs besides the verifier's forward (then measured per session);
    the calibration's prior (``prior_ratio`` over ``prior_mass`` predicted tokens, decayed by
    ``calibration_decay`` per step); ``min_gain``, the factor by which a tree's expected rate
    must beat a plain step's (a margin for the estimates' noise); ``probe_every``, the most
    steps between two probes while drafting does not pay (a probe asks the drafter beside a
    plain step and scores its tree against what the model commits); ``always_ask_below``, the
    fraction of a plain step under which the drafter is asked every step anyway (it finds
    nothing while the model writes new text and hits again when it copies: skipping steps then
    cost code editing a third of its accepted tokens); ``ahead_factor``, with drafting ahead
    (gateway/draft_ahead.py), how many times a step's most nodes its ahead call asks for (the
    next step's tree is the part of it below what this step commits).

    From ``govern_from`` requests in flight (0 = never) the gateway also measures, per load band,
    whether drafting pays at all (gateway/governor.py): epochs of ``epoch_rounds`` rounds of
    steps, and at least ``epoch_min_s`` of the gateway's time, with drafting on or off for every
    session, keeping the faster arm and trying the other one epoch in ``explore_every``. A lone session measures its own steps, so 1 needs no
    governor."""

    plain_from: int = 16
    step_overhead_ms: float = 2.0
    prior_ratio: float = 1.0
    prior_mass: float = 2.0
    calibration_decay: float = 0.9
    min_gain: float = 1.03
    probe_every: int = 16
    always_ask_below: float = 0.05
    govern_from: int = 2
    epoch_rounds: int = 6
    explore_every: int = 8
    epoch_min_s: float = 0.3
    ahead_factor: int = 2

    def __post_init__(self) -> None:
        if self.plain_from < 0:
            raise ConfigError(f"load policy plain_from: must be >= 0 (0 = off), got {self.plain_from}")
        if self.step_overhead_ms < 0:
            raise ConfigError(f"load policy step_overhead_ms: must be >= 0, got {self.step_overhead_ms}")
        if self.prior_ratio <= 0 or self.prior_mass <= 0:
            raise ConfigError(
                f"load policy prior_ratio ({self.prior_ratio}) and prior_mass ({self.prior_mass}): must be > 0"
            )
        if not 0 <= self.calibration_decay < 1:
            raise ConfigError(f"load policy calibration_decay: must be in [0, 1), got {self.calibration_decay}")
        if self.min_gain < 1:
            raise ConfigError(f"load policy min_gain: must be >= 1, got {self.min_gain}")
        if not 0 <= self.always_ask_below < 1:
            raise ConfigError(f"load policy always_ask_below: must be in [0, 1), got {self.always_ask_below}")
        if self.probe_every < 1:
            raise ConfigError(f"load policy probe_every: must be >= 1, got {self.probe_every}")
        if self.govern_from < 0:
            raise ConfigError(f"load policy govern_from: must be >= 0 (0 = off), got {self.govern_from}")
        if self.epoch_rounds < 1:
            raise ConfigError(f"load policy epoch_rounds: must be >= 1, got {self.epoch_rounds}")
        if self.epoch_min_s < 0:
            raise ConfigError(f"load policy epoch_min_s: must be >= 0, got {self.epoch_min_s}")
        if self.ahead_factor < 1:
            raise ConfigError(f"load policy ahead_factor: must be >= 1, got {self.ahead_factor}")
        if self.explore_every < 2:
            raise ConfigError(f"load policy explore_every: must be >= 2, got {self.explore_every}")

    def drafts_at(self, in_flight: int) -> bool:
        """False when the operator's switch makes every step plain at this load."""
        return not self.plain_from or in_flight < self.plain_from

    def starts_at_admission(self, in_flight: int, feeds_memory: bool = False) -> bool:
        """Whether a request opens its drafter session as it is admitted, `in_flight` counting
        it, so that StartSession overlaps its prefill; otherwise at its first step that may draft.

        A request alone on the verifier starts at once: there the overlap is all a start could
        cost, and its steps will draft. With others in flight a start is a bet that the request
        will draft, which under load it mostly does not (plain_from, the governor's plain epochs,
        trees that do not pay), and a start inserts the whole prompt into Redis: with its end, Redis
        time that grows with the prompt and, on a CPU of few cores, is taken from the verifier's
        (docs/benchmarks.md, "Figures behind design choices"). A deferred start costs its request
        at most one wait for the start, at its first drafting step (DraftSession.start). A request
        whose output `feeds_memory` (a conversation's session_id, the shared memory) starts at once
        below plain_from whatever the load: its EndSession is what hands the output to the memory
        for later requests.

        >>> policy = LoadPolicy(plain_from=16)
        >>> policy.starts_at_admission(1), policy.starts_at_admission(2), policy.starts_at_admission(16)
        (True, False, False)
        >>> policy.starts_at_admission(2, feeds_memory=True), policy.starts_at_admission(16, feeds_memory=True)
        (True, False)
        """
        return self.drafts_at(in_flight) and (in_flight == 1 or feeds_memory)


@dataclass(frozen=True)
class GatewayConfig:
    # Verifier replicas "host:port[,host:port...]": sessions stick to one (gateway/replicas.py).
    # Drafters: a comma list "ipv4:127.0.0.1:1,127.0.0.1:2" or "dns:///drafter:50052", balanced
    # round-robin per call (they are stateless). Exactly one of drafter_target and
    # embedded_drafter is set.
    verifier_target: str
    drafter_target: str = ""
    # Draft in the gateway's own process on this drafter config's Redis instead of calling
    # drafter replicas: one network hop fewer per step (gateway/embedded_drafter.py).
    embedded_drafter: DrafterConfig | None = None
    # None: plain decoding only.
    draft: DraftParams | None = field(default_factory=DraftParams)
    # Prompts longer than this are refused, or cut from the left when truncation is on.
    max_input_tokens: int = 2048
    truncation: bool = False
    # MindIE's speculationGamma (None: the plugin's tokens per step) and maxIterTimes (None: no
    # cap but maxSeqLen); with dynamic_algo a request needs max_new_tokens + gamma <= maxIterTimes.
    speculation_gamma: int | None = None
    max_iter_times: int | None = None
    # Used when a request leaves max_new_tokens at 0 (lowered to what maxIterTimes allows).
    default_max_new_tokens: int = 256
    # Deadline of every internal call without a shorter one below.
    rpc_timeout_s: float = 120.0
    # A Propose slower than this is given up: that step runs without a tree (a plain step), so a
    # slow or dead drafter costs at most this per step, and nothing of the output.
    propose_timeout_s: float = 0.5
    # StartSession and EndSession deadline; StartSession overlaps the verifier's prefill.
    drafter_session_timeout_s: float = 10.0
    # After a failed drafter call, steps run plain for this long before the drafter is tried again.
    drafter_retry_s: float = 1.0
    # Sizing of each step's tree from the verifier's cost curve (gateway/tree_sizing.py).
    load_policy: LoadPolicy = field(default_factory=LoadPolicy)
    # Draft also from every earlier request's output for this model (MindIE: memory_decoding
    # "caches historical inputs and outputs"). Off by default: tenants would draft from each
    # other's answers (the output stays exact, but acceptance then leaks what others asked),
    # and a benchmark's repeated prompts would draft from their own earlier answers.
    shared_memory: bool = False
    # Draft the next step's tree while the verifier runs this one (gateway/draft_ahead.py): "on",
    # "off", or "auto", on where the verifier runs on an accelerator (on a CPU the drafter's
    # work would take cores from the forward it overlaps). memory_decoding without dynamic_algo.
    overlap_drafting: str = "auto"
    # TLS of the public port (None: plaintext); with a client CA, clients need a certificate and,
    # when no tokens are set, its subject CN names their tenant.
    tls: ServerTLS | None = None
    # TLS towards the verifier and the drafters (None: plaintext); a client certificate for mTLS.
    backend_tls: ClientTLS | None = None
    # Bearer tokens, each naming a tenant; set, every API call needs one. Kept as digests only.
    tokens: BearerTokens = field(default_factory=BearerTokens)
    # Largest request the public port reads; larger ones are refused before anything parses them.
    max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES
    # Generations served at once (each holds a thread); one more is refused RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS["gateway"]
    # Where each request's span goes over OTLP/gRPC (vLLM's --otlp-traces-endpoint; runtime/tracing.py):
    # HOST:PORT or a grpc://, http:// or https:// URL; "": no tracing.
    otlp_traces_endpoint: str = ""
    # A log line per request once it ends (vLLM's --enable-log-requests; gateway/request_log.py),
    # and a line of the load every this many seconds while there is any (0: none).
    log_requests: bool = False
    log_stats_interval_s: float = 10.0
    # How often the verifier replicas' health is asked: while none serves, so does not the gateway
    # (its gRPC health, GET /health; gateway/backend_health.py). 0: never asked.
    health_check_interval_s: float = 2.0
    # The HTTP API's cross-origin (CORS) and request-id answers (gateway/http_options.py).
    http_options: HttpOptions = field(default_factory=HttpOptions)

    def __post_init__(self) -> None:
        if not self.verifier_target:
            raise ConfigError("verifier_target: must be set")
        if bool(self.drafter_target) == (self.embedded_drafter is not None):
            raise ConfigError(
                "drafter_target and embedded_drafter: set exactly one (drafter replicas, or drafting in the gateway)"
            )
        for name in (
            "max_input_tokens", "default_max_new_tokens", "rpc_timeout_s", "propose_timeout_s",
            "drafter_session_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.overlap_drafting not in OVERLAP_CHOICES:
            raise ConfigError(f"overlap_drafting: must be one of {', '.join(OVERLAP_CHOICES)}, got {self.overlap_drafting!r}")
        for name in ("log_stats_interval_s", "health_check_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: off), got {getattr(self, name)}")
        if self.drafter_retry_s < 0:
            raise ConfigError(f"drafter_retry_s: must be >= 0, got {self.drafter_retry_s}")
        check_limits(self.max_concurrent_rpcs, self.max_message_bytes)
        check_endpoint(self.otlp_traces_endpoint)
        # speculationGamma and maxIterTimes against the plugin, by the same rules table as config.json.
        check(CONFIG, self.facts())

    def facts(self, **more) -> Facts:
        """The rule facts this config fixes (plugin_params, speculationGamma, maxIterTimes)."""
        return Facts(
            plugin_params=asdict(self.draft) if self.draft else None,
            speculation_gamma=self.speculation_gamma,
            max_iter_times=self.max_iter_times,
            **more,
        )
