"""The verifier's protobuf-free core: sessions, their KV caches, prefill and tree verification.

Every session operation runs on one engine thread, which drains a queue (batching.py): each
iteration packs the queued verify steps of many sessions and chunks of pending prompts into
one forward. One thread because the model already uses every core, a session's cache must never
see two steps at once, and torch's OpenMP pool belongs to the thread that calls it. Each
session's logits are bit-identical to what it would get alone (see model.forward_batch), so
batching changes throughput, never tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Sequence

import torch

from pardec.runtime.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from pardec.verifier.api import Prefilled, Sampling, Verification
from pardec.verifier.engine.acceptance import accept_step, token_logprobs, tree_layout
from pardec.verifier.engine.admission import check_prefill, open_cache
from pardec.verifier.engine.bad_words import BannedSequences
from pardec.verifier.engine.grammar import Grammars
from pardec.verifier.engine.batching import CallWork, PrefillWork, VerifyWork, Work, WorkQueue, plan, settle
from pardec.verifier.engine.session import Session
from pardec.verifier.engine.stats import EngineStats
from pardec.verifier.engine.path_rules import RuledMatcher
from pardec.verifier.engine.thinking_budget import ThinkingBounds
from pardec.verifier.config import VerifierConfig
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.kernels.openmp import release_thread_pool
from pardec.verifier.engine.threads import ThreadChooser
from pardec.verifier.model.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Transformer, tokenizer: ChatTokenizer, model_name: str, config: VerifierConfig,
                 device: str | None = None):
        self.model, self.tokenizer, self.model_name, self.config = model, tokenizer, model_name, config
        self.device = torch.device(device or config.worker_devices[0])
        self.pool = model.new_pool(config.kv_pool_tokens, config.kv_block_tokens, self.device)
        # The device engine reads a step's tokens and tree on the host (it packs them into one
        # copy to the device); the modules read them where the model is.
        self.input_device = torch.device("cpu") if model.device_forward is not None else self.device
        self.stats = EngineStats()
        self.grammars = Grammars(tokenizer, model.args.vocab_size)
        self.cost_curve: list[tuple[int, int, float]] = []  # (tokens, batch, step_ms), see costcurve.py
        self._sessions: dict[str, Session] = {}
        self._prefilling: list[PrefillWork] = []
        # Prompts admitted but waiting (by priority, then oldest first) for the pool to promise what
        # they may use (at most admission_wait_s each).
        self._waiting: list[PrefillWork] = []
        self._deferred: list[VerifyWork] = []  # queued verifies left for the next forward
        # When the last forward's results went out, and what it took: stragglers are waited for
        # from then on, at most a share of a forward (batching.WorkQueue.take).
        self._last_forward_end, self._last_forward_s = 0.0, 0.0
        self._queue = WorkQueue()
        # Idle sessions are expired on this tick even when no work arrives.
        self._tick_s = min(1.0, config.session_idle_s / 4)
        # From here the engine thread runs the model: the building thread's OpenMP workers would
        # only slow its every parallel region down (openmp.py).
        release_thread_pool()
        self._threads = ThreadChooser(torch.get_num_threads(), adapt=config.adapt_threads and self.device.type == "cpu")
        self._engine_thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._engine_thread.start()

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def queue_depth(self) -> int:
        """Calls waiting for a forward (a racy read: for metrics)."""
        return self._queue.depth + len(self._deferred) + len(self._prefilling) + len(self._waiting)

    # ---- called from any thread -------------------------------------------------------------

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, seed: int | None, resume: bool = False,
        max_new_tokens: int = 0, cache_scope: str = "", generated: int = 0, priority: int = 0,
    ) -> Prefilled:
        """Caches the prompt (what the prefix cache holds of it is not computed again). With ``resume``,
        ``tokens`` also hold tokens generated elsewhere (the last ``generated``), and only
        max_seq_len bounds them.

        ``max_new_tokens`` (0: not said) is how many tokens the caller may generate: the session
        is admitted only once the pool promises it every block it may then use (prompt, those
        tokens and one tree), so it never runs out mid-way. A caller that does not say is
        promised its prompt only, and a later step of it may fail RESOURCE_EXHAUSTED."""
        check_prefill(self.config, self.vocab_size, session_id, tokens, resume, max_new_tokens, cache_scope, sampling,
                      generated)
        language, before = sampling.structured_output, tokens[len(tokens) - generated:]
        matcher = None if language is None else self.grammars.matcher(language, before)
        rules = [] if sampling.thinking_budget is None else [ThinkingBounds.of(sampling.thinking_budget, self.tokenizer)]
        bans = BannedSequences(sampling.bad_words) if sampling.bad_words else None
        if rules or bans:  # their masks after the language's, and the bans last
            matcher = RuledMatcher(rules, self.vocab_size, matcher, before, bans)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator().manual_seed(
                seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )
        work = PrefillWork(session_id, list(tokens), sampling, generator, max_new_tokens=max_new_tokens,
                           cache_scope=cache_scope, generated=generated, matcher=matcher, priority=priority)
        return self._queue.put(work).result()

    def verify(self, session_id: str, tokens: Sequence[int], parents: Sequence[int]) -> Verification:
        """One forward over the root and the tree; commits the accepted path to the cache."""
        if len(tokens) > self.config.max_tree_nodes:
            raise InvalidArgument(
                f"tree.token_ids: {len(tokens)} nodes exceed max_tree_nodes {self.config.max_tree_nodes}"
            )
        # The layout does not depend on the root's token (0 here); validating it off the engine
        # thread keeps that work out of everyone's step.
        layout = tree_layout(0, tokens, parents, self.vocab_size)
        return self._queue.put(VerifyWork(session_id, list(tokens), layout)).result()

    def release(self, session_id: str) -> bool:
        """Frees a session; False when there was none (release is idempotent)."""
        return self.call(lambda: self._release(session_id))

    def call(self, fn):
        """Runs fn() on the engine thread, between forwards, and returns its result."""
        return self._queue.put(CallWork(fn)).result()

    def close(self) -> None:
        for work in self._queue.close():
            work.future.set_exception(Unavailable("verifier: the engine is shutting down"))
        self._engine_thread.join()

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._queue.closed:
            try:
                self._iteration()
            except Exception:  # a bug in one iteration must not stop serving; its work already failed
                log.exception("engine iteration failed")
        for work in [*self._prefilling, *self._deferred, *self._waiting]:  # nobody will run them now
            work.future.set_exception(Unavailable("verifier: the engine is shutting down"))

    def _iteration(self) -> None:
        wait_s = min(self.config.batch_wait_ms / 1e3, self.config.batch_wait_share * self._last_forward_s)
        # A waiting prompt's deadline must be met even when no work arrives.
        idle_s = min([self._tick_s, *(w.deadline - time.monotonic() for w in self._waiting)])
        incoming = self._queue.take(
            max(0.0, idle_s), busy=bool(self._prefilling or self._deferred), wait_s=wait_s,
            budget=self.config.max_batch_tokens, ready=self._all_queued, not_before=self._last_forward_end,
        )
        self._expire_idle(incoming)
        self._admit_waiting()
        verifies, self._deferred = self._deferred, []
        for work in incoming:
            if isinstance(work, CallWork):
                settle(work, work.fn)
            elif isinstance(work, PrefillWork):
                settle(work, lambda w=work: self._admit(w), keep_open=True)
            else:
                verifies.append(work)
        # One step per session per forward; a second one waits its turn. Where the budget cannot take
        # them all, lower priorities go first (sorts are stable: then the oldest first).
        seen: set[str] = set()
        queued = []
        for work in verifies:
            (self._deferred if work.session_id in seen else queued).append(work)
            seen.add(work.session_id)
        queued.sort(key=lambda w: self._sessions[w.session_id].priority if w.session_id in self._sessions else 0)
        self._prefilling.sort(key=lambda w: w.priority)
        taken, chunks = plan([w.steps for w in queued], [p.remaining for p in self._prefilling],
                             self.config.max_batch_tokens, self.config.max_batch_sessions)
        self._deferred = queued[taken:] + self._deferred
        batch: list[tuple[Work, StepInput]] = []
        for work in queued[:taken]:
            settle(work, lambda w=work: batch.append((w, self._verify_input(w))), keep_open=True)
        for work, chunk in zip(self._prefilling, chunks):
            if chunk:
                batch.append((work, self._prefill_input(work, chunk)))
        if batch:
            self._forward(batch)

    def _all_queued(self, items: list[Work]) -> bool:
        """True when no live session is left out of the queued steps: waiting is pointless."""
        queued = {w.session_id for w in items if isinstance(w, VerifyWork)}
        return all(session_id in queued for session_id in self._sessions)

    def _admit(self, work: PrefillWork) -> None:
        pending = [*self._prefilling, *self._waiting]
        if work.session_id in self._sessions or any(p.session_id == work.session_id for p in pending):
            raise InvalidArgument(f"session_id: {work.session_id!r} already has a prefilled session")
        if len(self._sessions) + len(pending) >= self.config.max_sessions:
            raise ResourceExhausted(
                f"sessions: all {self.config.max_sessions} verifier sessions are in use (max_sessions); "
                "retry after other sessions finish"
            )
        ahead = [w for w in self._waiting if w.priority <= work.priority]  # nobody overtakes them
        if not ahead:
            try:
                return self._start_prefill(work)
            except ResourceExhausted:
                if self.config.admission_wait_s <= 0:
                    raise
        work.deadline = time.monotonic() + self.config.admission_wait_s
        self._waiting.insert(len(ahead), work)  # after those, before the lower priorities

    def _start_prefill(self, work: PrefillWork) -> None:
        work.cache, work.started = open_cache(self.pool, self.config, work), time.perf_counter()
        work.done = work.cached = work.cache.length  # the prompt's cached prefix
        self.stats.prompt_tokens += len(work.tokens)
        self.stats.cached_prompt_tokens += work.cached
        self._prefilling.append(work)

    def _admit_waiting(self) -> None:
        """Starts the waiting prompts that now fit, in their order; fails those past their wait."""
        now = time.monotonic()
        while self._waiting:
            work = self._waiting[0]
            try:
                self._start_prefill(work)
            except ResourceExhausted as error:
                for late in [w for w in self._waiting if w.deadline <= now]:
                    self._waiting.remove(late)
                    late.future.set_exception(ResourceExhausted(
                        f"{error} (waited admission_wait_s {self.config.admission_wait_s:g} s)"
                    ))
                if work in self._waiting:
                    return
                continue
            except Exception as error:  # not a matter of capacity: this prompt alone fails
                work.future.set_exception(error)
            self._waiting.pop(0)

    def _prefill_input(self, work: PrefillWork, chunk: int) -> StepInput:
        device = self.input_device
        tokens = torch.tensor(work.tokens[work.done : work.done + chunk], dtype=torch.int64, device=device)
        last = work.done + chunk == len(work.tokens)
        rows = None if work.scores_prompt else torch.tensor([chunk - 1] if last else [], dtype=torch.int64, device=device)
        return StepInput(
            tokens, torch.arange(chunk, device=device), torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(),
            work.cache, output_rows=rows,
        )

    def _verify_input(self, work: VerifyWork) -> StepInput:
        session = self._sessions.get(work.session_id)
        if session is None:
            raise NotFound(f"session_id: no verifier session {work.session_id!r} (never prefilled, released or expired)")
        tokens, layout = work.tokens, work.layout
        if session.matcher is not None:  # only the nodes its language and rules may accept are computed
            work.masked = session.matcher.mask_tree(work.tokens, work.layout)
        if work.masked is not None:
            tokens, layout = work.masked.tokens, work.masked.layout
        rows = len(tokens) + 1
        if session.cache.length + rows > self.config.max_seq_len:
            raise ResourceExhausted(
                f"tree: session holds {session.cache.length} positions; {rows} more exceed max_seq_len {self.config.max_seq_len}"
            )
        session.cache.reserve(rows, why=f"a step of {rows} tokens")
        return StepInput(
            torch.tensor([session.root, *tokens], dtype=torch.int64, device=self.input_device),
            layout.depths.to(self.input_device),
            layout.ancestors.to(self.input_device),
            session.cache,
        )

    def _forward(self, batch: list[tuple[Work, StepInput]]) -> None:
        rows, start = sum(item.tokens.shape[0] for _, item in batch), time.perf_counter()
        outputs = self._threads.run(rows, lambda: self._forward_isolated(batch))  # threads.py
        forward_ms = (time.perf_counter() - start) * 1e3
        self.stats.forwards += 1
        self.stats.forward_seconds += forward_ms / 1e3
        self.stats.rows += rows
        for (work, item), logits in zip(batch, outputs):
            if isinstance(logits, Exception):  # this item's own forward failed: it alone hears of it
                if isinstance(work, PrefillWork):
                    self._drop_prefill(work)
                work.future.set_exception(logits)
            elif isinstance(work, VerifyWork):
                self.stats.verify_steps += 1
                settle(work, lambda w=work, i=item, lg=logits: self._finish_verify(w, i, lg, forward_ms))
            else:
                self.stats.prefill_chunks += 1
                logits = work.score_prompt(logits) if work.scores_prompt else logits
                work.done += item.tokens.shape[0]
                item.cache.commit(torch.arange(item.tokens.shape[0]), trim=False)
                if self.config.prefix_caching and work.remaining:
                    # Findable as soon as written: a prompt admitted meanwhile that starts the
                    # same way (a burst behind one long system prompt) computes only the rest.
                    self.pool.prefixes.remember(work.cache.blocks, work.tokens[: work.done], work.cache_scope)
                if not work.remaining:
                    self._prefilling.remove(work)
                    settle(work, lambda w=work, lg=logits: self._finish_prefill(w, lg))
        self._last_forward_end, self._last_forward_s = time.monotonic(), forward_ms / 1e3

    def _forward_isolated(self, batch: list[tuple[Work, StepInput]]) -> list:
        """Each item's logits, or the error its own forward raised. A batch that fails runs
        again in halves, down to single items, so one bad item fails only itself. A rerun is
        safe and exact: a forward writes only the step's rows past each cache's committed
        positions (rewritten by the rerun), and a session's logits do not depend on the batch."""
        try:
            with torch.inference_mode():
                return list(self.model.forward_batch([item for _, item in batch]))
        except Exception as error:
            if len(batch) == 1:
                log.exception("forward of one %s failed", type(batch[0][0]).__name__)
                return [error]
        half = len(batch) // 2
        return self._forward_isolated(batch[:half]) + self._forward_isolated(batch[half:])

    def _finish_prefill(self, work: PrefillWork, logits: torch.Tensor) -> Prefilled:
        try:
            layout = tree_layout(0, [], [], self.vocab_size)
            masked = None if work.matcher is None else work.matcher.mask_tree([], layout)
            first, _ = accept_step(logits, layout, [0], lambda: torch.tensor(work.tokens, dtype=torch.int64), work.sampling,
                                   work.generator, generated=work.generated, allowed=masked and masked.allowed,
                                   banned=masked and masked.banned)
            if work.matcher is not None:
                work.matcher.advance([first.bonus_token])
        except BaseException:  # the session never comes to be: its blocks go back now
            work.cache.free()
            raise
        if self.config.prefix_caching:
            self.pool.prefixes.remember(work.cache.blocks, work.tokens, work.cache_scope)
        self._sessions[work.session_id] = Session(work.cache, [*work.tokens, first.bonus_token], work.sampling,
                                                  work.generator, work.cache_scope,
                                                  prompt_tokens=len(work.tokens) - work.generated, matcher=work.matcher,
                                                  priority=work.priority)
        top = work.sampling.logprobs
        logprob = None if top is None else token_logprobs(logits, [0], [first.bonus_token], top)[0]
        return Prefilled(first.bonus_token, (time.perf_counter() - work.started) * 1e3, work.cached, logprob,
                         tuple(work.prompt_logprobs))

    def _finish_verify(self, work: VerifyWork, item: StepInput, logits: torch.Tensor, forward_ms: float) -> Verification:
        start = time.perf_counter()
        session = self._sessions[work.session_id]
        masked, matcher = work.masked, session.matcher
        layout = work.layout if masked is None else masked.layout
        row_tokens = [session.root, *(work.tokens if masked is None else masked.tokens)]
        # The history only for a penalty or sampling (built when asked: it grows with the output).
        history = lambda: torch.tensor(session.history, dtype=torch.int64)  # noqa: E731
        result, node_argmax = accept_step(logits, layout, row_tokens, history, session.sampling, session.generator,
                                          generated=session.generated, allowed=masked and masked.allowed,
                                          banned=masked and masked.banned)
        filled = session.cache.length // self.pool.block_tokens
        session.cache.commit(torch.tensor([0, *result.accepted_rows], dtype=torch.int64))
        accepted_tokens = [row_tokens[r] for r in result.accepted_rows]
        session.history.extend([*accepted_tokens, result.bonus_token])
        if self.config.prefix_caching and session.cache.length // self.pool.block_tokens > filled:
            session.remember_blocks()  # a block filled: findable now (a beam's sibling prefills this text)
        if matcher is not None:
            matcher.advance([*accepted_tokens, result.bonus_token])
        session.last_used = time.monotonic()
        top, committed = session.sampling.logprobs, [*accepted_tokens, result.bonus_token]
        return Verification(
            accepted_tokens=accepted_tokens,
            accepted_nodes=[r - 1 for r in result.accepted_rows] if masked is None else masked.sent_nodes(
                result.accepted_rows),
            bonus_token=result.bonus_token,
            node_argmax=node_argmax if masked is None else masked.sent_argmax(node_argmax, work.tokens),
            compute_ms=forward_ms + (time.perf_counter() - start) * 1e3,
            logprobs=[] if top is None else token_logprobs(logits, [0, *result.accepted_rows], committed, top),
        )

    def _release(self, session_id: str) -> bool:
        if (session := self._sessions.pop(session_id, None)) is not None:
            self._close(session)
            return True
        for work in [*self._prefilling, *self._waiting]:
            if work.session_id == session_id:
                self._drop_prefill(work)
                work.future.set_exception(NotFound(f"session_id: {session_id!r} was released during its prefill"))
                return True
        return False

    def _drop_prefill(self, work: PrefillWork) -> None:
        for pending in [queue for queue in (self._prefilling, self._waiting) if work in queue]:
            pending.remove(work)
        if work.cache is not None:
            work.cache.free()

    def _expire_idle(self, incoming: list[Work]) -> None:
        deadline = time.monotonic() - self.config.session_idle_s
        busy = {w.session_id for w in [*self._deferred, *incoming] if isinstance(w, VerifyWork)}
        for session_id in [s for s, v in self._sessions.items() if v.last_used < deadline and s not in busy]:
            log.info("session %s expired after %.0f s idle", session_id, self.config.session_idle_s)
            self._close(self._sessions.pop(session_id))

    def _close(self, session: Session) -> None:
        """Frees a session's blocks, those full of its tokens findable (a next turn's prefix)."""
        if self.config.prefix_caching:  # before the blocks go back: their contents stay findable
            session.remember_blocks()
        session.cache.free()
