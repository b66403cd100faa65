"""The gateway's configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gateway.rules import CONFIG, PLUGIN_TYPES, Facts, check
from pardec.errors import ConfigError

__all__ = ["PLUGIN_TYPES", "DraftParams", "GatewayConfig", "LoadPolicy"]


@dataclass(frozen=True)
class DraftParams:
    """MindIE's plugin_params: the parallel-decoding algorithm and its parameters."""

    plugin_type: str = "memory_decoding"
    # memory_decoding: most candidate nodes per step.
    decoding_length: int = 16
    # memory_decoding: adaptive candidate length.
    dynamic_algo: bool = False
    # la (lookahead): N, W, G.
    level: int = 4
    window: int = 5
    guess_set_size: int = 5

    def __post_init__(self) -> None:
        # The ranges live in one place, the rules table; here only its plugin_params rows can break.
        check(CONFIG, Facts(plugin_params=asdict(self)))

    @property
    def tokens_per_step(self) -> int:
        """Draft tokens one step may carry: MindIE's lower bound for speculationGamma."""
        return Facts(plugin_params=asdict(self)).tokens_per_step


@dataclass(frozen=True)
class LoadPolicy:
    """Drafting pays at low concurrency and costs at high concurrency (MindIE's own condition 1):
    below ``shrink_from`` requests in flight a step gets the full tree, from ``plain_from`` on no
    tree at all, and in between a tree shrunk linearly.

    Why: every draft node is a row of the verifier's forward. Alone, a session's step is bound by
    streaming the weights and spare rows are nearly free; batched with many sessions the forward
    becomes compute-bound, and rows that are mostly rejected (~1.3 accepted per 16-node tree on
    chat text) cost throughput that plain steps would not. ``plain_from`` = 16 keeps throughput
    at 16+ concurrent sessions at plain decoding's. The verifier's ModelInfo.cost_curve can later
    set these from measurement instead of defaults."""

    shrink_from: int = 4
    plain_from: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.shrink_from <= self.plain_from:
            raise ConfigError(
                f"load policy: need 1 <= shrink_from ({self.shrink_from}) <= plain_from ({self.plain_from})"
            )

    def nodes(self, full: int, in_flight: int) -> int:
        """Draft nodes for one step of a request when ``in_flight`` requests (itself included) run."""
        if in_flight < self.shrink_from:
            return full
        if in_flight >= self.plain_from:
            return 0
        share = (self.plain_from - in_flight) / (self.plain_from - self.shrink_from + 1)
        return max(1, round(full * share))


@dataclass(frozen=True)
class GatewayConfig:
    # gRPC targets; a comma list "ipv4:127.0.0.1:1,127.0.0.1:2" or "dns:///drafter:50052"
    # is balanced round-robin across replicas.
    verifier_target: str
    drafter_target: str
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
    load_policy: LoadPolicy = field(default_factory=LoadPolicy)
    # Draft also from every earlier request's output for this model (MindIE: memory_decoding
    # "caches historical inputs and outputs"). Off by default: tenants would draft from each
    # other's answers (the output stays exact, but acceptance then leaks what others asked),
    # and a benchmark's repeated prompts would draft from their own earlier answers.
    shared_memory: bool = False

    def __post_init__(self) -> None:
        if not self.verifier_target or not self.drafter_target:
            raise ConfigError("verifier_target and drafter_target: both must be set")
        for name in (
            "max_input_tokens", "default_max_new_tokens", "rpc_timeout_s", "propose_timeout_s",
            "drafter_session_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.drafter_retry_s < 0:
            raise ConfigError(f"drafter_retry_s: must be >= 0, got {self.drafter_retry_s}")
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
