"""One verifier session: its KV cache, its tokens and how it samples, between a prefill and its release."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pardec.verifier.api import Sampling
from pardec.verifier.model.kvcache import PagedCache


@dataclass
class Session:
    cache: PagedCache
    history: list[int]  # prompt + committed tokens; the last one is the root (not yet cached)
    sampling: Sampling
    generator: torch.Generator | None
    cache_scope: str = ""  # who may share its cached blocks (prefix_cache.py)
    last_used: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0  # of history, the prompt's
    matcher: object | None = None  # where the output has a structured language: its grammar.LanguageMatcher
    priority: int = 0  # lower goes first where the engine must choose (vLLM's)

    @property
    def root(self) -> int:
        return self.history[-1]

    def remember_blocks(self) -> None:
        """Its cache's full blocks findable in the pool's prefix index, under its scope."""
        self.cache.pool.prefixes.remember(self.cache.blocks, self.history[: self.cache.length], self.cache_scope)

    @property
    def generated(self) -> int:
        """Tokens generated so far, the root included: the index of the token the root's row predicts."""
        return len(self.history) - self.prompt_tokens
