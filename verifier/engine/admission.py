"""Admission: what a new session is promised of the KV pool before its prompt runs.

A session admitted with room for its prompt only could find the pool full at any later step,
when its neighbours have grown, and fail mid-way with tokens already sent to its client. So a
caller that says how many tokens it may generate is promised, up front, every block it may then
use (KVPool.promise): blocks set aside in the pool's accounting, taken only as the session
grows. What cannot be promised is refused, or waits (engine.py, admission_wait_s), before any
token is produced.
"""

from __future__ import annotations

from collections.abc import Sequence

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.batching import PrefillWork
from pardec.verifier.model.kvcache import KVPool, PagedCache


# Session keys and cache scopes: the gateway's ids are 32 hex digits and its scopes tenant names;
# the bound keeps error messages and the session table small.
MAX_SESSION_ID_CHARS = MAX_CACHE_SCOPE_CHARS = 256


def check_prefill(
    config: VerifierConfig, vocab_size: int, session_id: str, tokens: Sequence[int], resume: bool,
    max_new_tokens: int, cache_scope: str, sampling: Sampling | None = None, generated: int = 0,
) -> None:
    """INVALID_ARGUMENT, naming the field and the rule, for a prefill no session may start from."""
    if not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise InvalidArgument(f"session_id: must be 1 to {MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")
    if not tokens:
        raise InvalidArgument("token_ids: the prompt must hold at least one token")
    if resume and len(tokens) >= config.max_seq_len:
        raise InvalidArgument(
            f"token_ids: {len(tokens)} tokens to resume leave no room under max_seq_len {config.max_seq_len}"
        )
    if generated and not (resume and 0 < generated < len(tokens)):
        raise InvalidArgument(f"generated_tokens: {generated} must be fewer than the {len(tokens)} tokens, "
                              "and only with resume")
    if max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
    if len(cache_scope) > MAX_CACHE_SCOPE_CHARS:
        raise InvalidArgument(f"cache_scope: must be at most {MAX_CACHE_SCOPE_CHARS} characters")
    if not resume and len(tokens) > config.max_input_tokens:
        raise InvalidArgument(
            f"token_ids: prompt of {len(tokens)} tokens exceeds max_input_tokens {config.max_input_tokens}"
        )
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token_ids: {bad} is outside the vocabulary [0, {vocab_size})")
    if sampling is not None:
        for name, ids in (("sampling.logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("sampling.allowed_token_ids", sampling.allowed_token_ids),
                          ("stop_token_ids", sampling.stop_token_ids),
                          *((f"sampling.bad_words[{index}]", words) for index, words in enumerate(sampling.bad_words))):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"{name}: {bad} is outside the vocabulary [0, {vocab_size})")


def may_use(prompt: int, max_new_tokens: int, config: VerifierConfig) -> int:
    """Positions a session of `prompt` tokens may hold at most, generating `max_new_tokens`.

    Before a step the cache holds the prompt and every generated token but the last (the root,
    not cached yet); the step adds the root and at most max_tree_nodes. The caller steps only
    while fewer than max_new_tokens are generated, so prompt + max_new_tokens + max_tree_nodes
    bounds every step; and no step may take a session past max_seq_len.

    >>> may_use(100, 50, VerifierConfig(max_tree_nodes=16))
    166
    >>> may_use(2000, 1000, VerifierConfig(max_tree_nodes=16, max_seq_len=2560))
    2560
    """
    return max(prompt, min(prompt + max_new_tokens + config.max_tree_nodes, config.max_seq_len))


def open_cache(pool: KVPool, config: VerifierConfig, work: PrefillWork) -> PagedCache:
    """A cache holding the blocks of the prompt and, when the caller said max_new_tokens, the
    promise of all the session may use; ResourceExhausted, having taken nothing, otherwise. With
    prefix caching, the blocks of the prompt's longest cached prefix come from the pool's index
    already computed: the cache's length says how many positions need no forward."""
    cache = pool.session()
    prompt = len(work.tokens)
    try:
        if work.max_new_tokens:
            cache.promise(may_use(prompt, work.max_new_tokens, config), why=(
                f"a session of {prompt} prompt tokens, max_new_tokens {work.max_new_tokens} "
                f"and a tree of max_tree_nodes {config.max_tree_nodes}"
            ))
        if config.prefix_caching and not work.scores_prompt:  # cached blocks come without logits
            # The last prompt token is always computed: its logits give the first token.
            cached = pool.prefixes.match(work.tokens, (prompt - 1) // pool.block_tokens, work.cache_scope)
            if cached:
                cache.adopt(cached, why=f"a prompt of {prompt} tokens")
        # The whole prompt's blocks up front, so a prefill never fails halfway through.
        cache.reserve(prompt - cache.length, why=f"a prompt of {prompt} tokens")
    except BaseException:
        cache.free()
        raise
    return cache
