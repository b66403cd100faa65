"""The verifier's own step cost, measured once at startup and published in ModelInfo.cost_curve.

Whether a draft tree pays off depends on what a bigger step costs here: on a memory-bound CPU a
16-token step costs little more than a 1-token one, on other hardware or at high batch it may
not. The drafter and gateway read this curve to size trees instead of guessing.
"""

from __future__ import annotations

import time

import torch

from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.transformer import Transformer

TREE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
# Up to 16 sessions: extrapolating from 1 and 4 misjudged what a tree costs at 16 and 32 requests
# in flight (trees were verified that cost more than they gained there).
BATCHES = (1, 4, 16)
# Most tokens of one measured forward (tokens per session x sessions): 16 sessions are measured
# up to 16 tokens each; larger steps are extrapolated along the batch's last segment.
MAX_ROWS = 256
# Positions already cached in each session while measuring: attention cost grows with it, and
# this is a typical prompt plus a few hundred generated tokens.
CONTEXT = 256
REPEATS = 3


def synchronize(device: torch.device) -> None:
    """Waits for queued kernels, so wall time is compute time on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # torch.npu exists once torch_npu is imported (devices.py)


@torch.inference_mode()
def measure_cost_curve(
    model: Transformer, pool: KVPool, tree_tokens=TREE_TOKENS, batches=BATCHES, context=CONTEXT, repeats=REPEATS
) -> list[tuple[int, int, float]]:
    """Best-of-`repeats` wall time of one forward for every (tokens per session, sessions) pair of
    at most MAX_ROWS tokens, as [(tokens, batch, step_ms)]. Uses max(batches) x (context + max
    tokens) positions of the pool, given back before it returns; steps are never committed, so
    every repeat sees the same cache."""
    device = pool.kv.device
    generator = torch.Generator().manual_seed(0)
    # A small pool measures the batches it can hold (the gateway extrapolates the rest).
    per_session = context + max(tree_tokens) + pool.block_tokens
    batches = [batch for batch in batches if batch == min(batches) or batch * per_session <= pool.free_tokens]
    caches = [pool.session() for _ in range(max(batches))]
    try:
        prompt = torch.randint(0, model.args.vocab_size, (context,), generator=generator).to(device)
        for cache in caches:
            cache.reserve(context, why="measuring the cost curve")
        positions = torch.arange(context, device=device)
        causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()
        no_rows = torch.zeros(0, dtype=torch.int64, device=device)
        model.forward_batch([StepInput(prompt, positions, causal, cache, no_rows) for cache in caches])
        for cache in caches:
            cache.commit(positions)
            cache.reserve(max(tree_tokens), why="measuring the cost curve")

        curve = []
        for batch in batches:
            for tokens in (t for t in tree_tokens if t * batch <= MAX_ROWS or t == min(tree_tokens)):
                # A chain: a step's cost depends on its token count, not on the tree's shape.
                steps = [
                    StepInput(
                        torch.randint(0, model.args.vocab_size, (tokens,), generator=generator).to(device),
                        torch.arange(tokens, device=device),
                        torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril(),
                        cache,
                    )
                    for cache in caches[:batch]
                ]
                times = []
                for repeat in range(repeats + 1):
                    synchronize(device)
                    start = time.perf_counter()
                    model.forward_batch(steps)
                    synchronize(device)
                    if repeat:  # the first run warms caches and allocators
                        times.append((time.perf_counter() - start) * 1e3)
                # The fastest repeat: other work on the machine only ever adds time, and one
                # inflated point makes every tree of that size look dear for the server's life.
                curve.append((tokens, batch, min(times)))
        return curve
    finally:
        for cache in caches:
            cache.free()
