"""The gateway's configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pardec.errors import ConfigError

PLUGIN_TYPES = ("memory_decoding", "la")


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
        if self.plugin_type not in PLUGIN_TYPES:
            raise ConfigError(f"plugin_type: {self.plugin_type!r} must be one of {PLUGIN_TYPES}")
        for name, low, high in (
            ("decoding_length", 1, 16), ("level", 3, 16), ("window", 1, 16), ("guess_set_size", 1, 16)
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ConfigError(f"plugin_params.{name}: {value} is outside [{low}, {high}]")

    @property
    def tokens_per_step(self) -> int:
        """Draft tokens one step may carry: MindIE's lower bound for speculationGamma."""
        if self.plugin_type == "la":
            return (self.level - 1) * (self.window + self.guess_set_size)
        return self.decoding_length


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
    # Used when a request leaves max_new_tokens at 0.
    default_max_new_tokens: int = 256
    # Deadline of every internal call.
    rpc_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.verifier_target or not self.drafter_target:
            raise ConfigError("verifier_target and drafter_target: both must be set")
        if self.max_input_tokens < 1 or self.default_max_new_tokens < 1 or self.rpc_timeout_s <= 0:
            raise ConfigError("max_input_tokens, default_max_new_tokens and rpc_timeout_s must be positive")
