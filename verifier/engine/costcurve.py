"""The verifier's own step cost, measured once at startup and published in ModelInfo.cost_curve.

Whether a draft tree pays off depends on what a bigger step costs here: on a memory-bound CPU a
16-token step costs little more than a 1-token one, on other hardware or at high batch it may
not. The drafter and gateway read this curve to size trees instead of guessing.

Measuring takes a few seconds, most of a start from the prepared-weight cache, so a curve is kept
beside that cache (`remembered_cost_curve`) and measured again only when something that sets a
step's cost changes: the checkpoint, the device and the host's processor (and how many of its
CPUs this process may use), the thread count, the quantization and kernels chosen, the pool's
size and block size, or the code of the model, its kernels or the engine. Deleting the kept file
measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Callable

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
# The positions a measured session reaches: a model sized to fewer could not be measured.
POSITIONS = CONTEXT + max(TREE_TOKENS)
# The code whose changes make a kept curve stale (relative to the verifier package).
TIMED_CODE = ("model", "kernels", "engine")

log = logging.getLogger(__name__)


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
        # The cached positions' contents do not change what a step costs, only their number: they
        # are zeroed and committed as they are, without running the prompt through the model (a
        # forward of max(batches) x context tokens, most of what a measurement would cost).
        positions = torch.arange(context, device=device)
        for cache in caches:
            cache.reserve(context, why="measuring the cost curve")
            pool.kv[:, :, :, cache.slots[:context]] = 0
            cache.begin_step(context)
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


def host_processor() -> str:
    """The processor's model name and logical CPU count: two hosts alike here step alike."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} x{os.cpu_count()} ({usable} usable)"


def remembered_cost_curve(directory: str | os.PathLike, identity: dict,
                          measure: Callable[[], list[tuple[int, int, float]]]) -> list[tuple[int, int, float]]:
    """The curve kept in `directory` for `identity` (what the caller knows sets the step cost:
    checkpoint, device, kernels, threads, block size; the host's processor and the timed code
    are added here), else `measure()`'s, then kept. A file that cannot be read or written costs
    a measurement, nothing more."""
    from pardec.verifier.prepare.cache import code_fingerprint

    document = json.dumps({**identity, "host": host_processor(), "code": code_fingerprint(TIMED_CODE)}, sort_keys=True)
    path = Path(directory) / "cost-curves" / f"{hashlib.sha256(document.encode()).hexdigest()[:32]}.json"
    try:
        kept = json.loads(path.read_text())
        curve = [(int(tokens), int(batch), float(ms)) for tokens, batch, ms in kept["curve"]]
        if not curve or any(ms <= 0 for _, _, ms in curve):
            raise ValueError("an empty curve, or a step that took no time")
        log.info("cost curve measured %s, kept in %s (delete it to measure again)", kept.get("measured", "?"), path)
        return curve
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("cost curve kept in %s unreadable (%s); measuring again", path, error)
    curve = measure()
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "identity": json.loads(document),
                                         "curve": curve}))
        os.replace(temporary, path)
    except OSError as error:
        log.warning("could not keep the cost curve in %s (%s)", path, error)
        temporary.unlink(missing_ok=True)
    return curve
