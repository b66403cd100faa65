"""What an engine has done since it started: forwards, rows and time (the verifier's metrics read it)."""

from dataclasses import dataclass


@dataclass
class EngineStats:
    forwards: int = 0
    rows: int = 0  # tokens through the model
    verify_steps: int = 0
    prefill_chunks: int = 0
    forward_seconds: float = 0.0
    prompt_tokens: int = 0  # of every prompt admitted
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache (no forward)
