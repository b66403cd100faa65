"""The verifier's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from pardec.errors import ConfigError

QUANTIZATIONS = ("w8a8", "none")


@dataclass(frozen=True)
class VerifierConfig:
    # GGUF file or Hugging Face checkpoint directory; None = the bundled SmolLM2-135M-Instruct.
    model_path: str | None = None
    # "w8a8" serves; "none" (float) exists as a correctness reference.
    quantization: str = "w8a8"
    device: str = "cpu"
    # Longest sequence a session may hold: prompt + generated + one step's tree (maxSeqLen).
    max_seq_len: int = 2560
    # Longest prompt accepted (maxInputTokenLen).
    max_input_tokens: int = 2048
    # Most draft nodes one verify call may carry; MindIE's largest lookahead tree,
    # (16 - 1) * (16 + 16) = 480 nodes, fits.
    max_tree_nodes: int = 512
    # Concurrent sessions held; more get RESOURCE_EXHAUSTED.
    max_sessions: int = 64
    # A session untouched for this long is released (its client vanished).
    session_idle_s: float = 600.0
    # torch intra-op threads; 0 = torch's default.
    threads: int = 0

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: {self.quantization!r} is not one of {QUANTIZATIONS}")
        if not self.device.split(":")[0] in ("cpu", "cuda", "npu"):
            raise ConfigError(f"device: {self.device!r} must be cpu, cuda[:N] or npu[:N]")
        if self.max_input_tokens < 1 or self.max_seq_len <= self.max_input_tokens:
            raise ConfigError(
                f"max_seq_len ({self.max_seq_len}) must exceed max_input_tokens ({self.max_input_tokens}) >= 1"
            )
        for name in ("max_tree_nodes", "max_sessions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.session_idle_s <= 0 or self.threads < 0:
            raise ConfigError("session_idle_s must be > 0 and threads >= 0")
