"""The verifier's protobuf-free core: sessions, their KV caches, prefill and tree verification.

Every session operation runs on one dedicated engine thread: the model already uses every
core, a session's KV cache must never see two steps at once, and torch's OpenMP pool belongs to
the thread that calls it, so one thread keeps one pool instead of one per gRPC worker.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from pardec.errors import InvalidArgument, NotFound, ResourceExhausted
from verifier.acceptance import Sampling, accept, tree_layout
from verifier.config import VerifierConfig
from verifier.model import KVCache, Transformer
from verifier.tokenizer import ChatTokenizer

# Spare KV capacity reserved at prefill so the first steps do not reallocate.
_HEADROOM = 256


@dataclass
class _Session:
    cache: KVCache
    history: list[int]  # prompt + committed tokens; the last one is the root (not yet cached)
    sampling: Sampling
    generator: torch.Generator | None
    last_used: float = field(default_factory=time.monotonic)

    @property
    def root(self) -> int:
        return self.history[-1]


@dataclass(frozen=True)
class VerifyResult:
    accepted_tokens: list[int]
    accepted_nodes: list[int]
    bonus_token: int
    node_argmax: list[int]  # after the root, then after each node
    compute_ms: float


class Engine:
    def __init__(self, model: Transformer, tokenizer: ChatTokenizer, model_name: str, config: VerifierConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self.device = torch.device(config.device)
        self._sessions: dict[str, _Session] = {}
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, seed: int | None
    ) -> tuple[int, float]:
        """Caches the prompt and returns (first generated token, compute ms)."""
        if not session_id:
            raise InvalidArgument("session_id: must not be empty")
        if not tokens:
            raise InvalidArgument("token_ids: the prompt must hold at least one token")
        if len(tokens) > self.config.max_input_tokens:
            raise InvalidArgument(
                f"token_ids: prompt of {len(tokens)} tokens exceeds max_input_tokens {self.config.max_input_tokens}"
            )
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})")
        generator = None
        if not sampling.greedy:
            generator = torch.Generator().manual_seed(
                seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )
        return self._engine_thread.submit(self._prefill, session_id, tokens, sampling, generator).result()

    def _prefill(self, session_id, tokens, sampling, generator) -> tuple[int, float]:
        self._expire_idle()
        if session_id in self._sessions:
            raise InvalidArgument(f"session_id: {session_id!r} already has a prefilled session")
        if len(self._sessions) >= self.config.max_sessions:
            raise ResourceExhausted(
                f"sessions: all {self.config.max_sessions} verifier sessions are in use"
            )
        start = time.perf_counter()
        count = len(tokens)
        cache = KVCache(self.model.args, min(count + _HEADROOM, self.config.max_seq_len), self.device)
        steps = torch.arange(count, dtype=torch.int64)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(tokens, dtype=torch.int64, device=self.device),
                steps.to(self.device),
                torch.ones(count, count, dtype=torch.bool).tril().to(self.device),
                cache,
                output_rows=torch.tensor([count - 1], device=self.device),
            )
            cache.commit(steps.to(self.device))
        history = torch.tensor(tokens, dtype=torch.int64)
        first = accept(logits.cpu(), tree_layout(0, [], [], self.vocab_size), [0], history, sampling, generator)
        self._sessions[session_id] = _Session(cache, [*tokens, first.bonus_token], sampling, generator)
        return first.bonus_token, (time.perf_counter() - start) * 1e3

    def verify(self, session_id: str, tokens: Sequence[int], parents: Sequence[int]) -> VerifyResult:
        """One forward over the root and the tree; commits the accepted path to the cache."""
        if len(tokens) > self.config.max_tree_nodes:
            raise InvalidArgument(
                f"tree.token_ids: {len(tokens)} nodes exceed max_tree_nodes {self.config.max_tree_nodes}"
            )
        return self._engine_thread.submit(self._verify, session_id, tokens, parents).result()

    def _verify(self, session_id: str, tokens: Sequence[int], parents: Sequence[int]) -> VerifyResult:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no verifier session {session_id!r} (never prefilled, released or expired)")
        layout = tree_layout(session.root, tokens, parents, self.vocab_size)
        rows = len(tokens) + 1
        if session.cache.length + rows > self.config.max_seq_len:
            raise ResourceExhausted(
                f"tree: session holds {session.cache.length} positions; {rows} more exceed max_seq_len {self.config.max_seq_len}"
            )
        start = time.perf_counter()
        session.last_used = time.monotonic()
        row_tokens = [session.root, *tokens]
        session.cache.reserve(rows)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(row_tokens, dtype=torch.int64, device=self.device),
                layout.depths.to(self.device),
                layout.ancestors.to(self.device),
                session.cache,
            ).cpu()
            history = torch.tensor(session.history, dtype=torch.int64)
            result = accept(logits, layout, row_tokens, history, session.sampling, session.generator)
            kept_rows = [0, *result.accepted_rows]
            session.cache.commit(torch.tensor(kept_rows, dtype=torch.int64, device=self.device))
        accepted_tokens = [row_tokens[r] for r in result.accepted_rows]
        session.history.extend([*accepted_tokens, result.bonus_token])
        return VerifyResult(
            accepted_tokens=accepted_tokens,
            accepted_nodes=[r - 1 for r in result.accepted_rows],
            bonus_token=result.bonus_token,
            node_argmax=logits.argmax(dim=-1).tolist(),
            compute_ms=(time.perf_counter() - start) * 1e3,
        )

    def release(self, session_id: str) -> bool:
        """Frees a session; False when there was none (release is idempotent)."""
        return self._engine_thread.submit(lambda: self._sessions.pop(session_id, None) is not None).result()

    def _expire_idle(self) -> None:
        deadline = time.monotonic() - self.config.session_idle_s
        for session_id in [s for s, v in self._sessions.items() if v.last_used < deadline]:
            del self._sessions[session_id]
