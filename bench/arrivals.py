"""When a benchmark's requests are sent: an open-loop arrival schedule (bench/serve.py)."""

from __future__ import annotations

import math
import random


def arrival_offsets(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of ``count`` requests is sent, in seconds from the start: gaps drawn from a gamma
    distribution of mean 1/rate (shape ``burstiness``: 1 is a Poisson process, below 1 burstier,
    above more even); ``rate`` inf sends all at once. The same seed, the same schedule.

    >>> arrival_offsets(3, math.inf)
    [0.0, 0.0, 0.0]
    >>> [round(t, 3) for t in arrival_offsets(3, rate=2.0, seed=0)]
    [0.0, 0.93, 1.64]
    """
    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    if not rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf: all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness: must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    draw, offsets, now = random.Random(seed), [], 0.0
    for index in range(count):
        if index:
            now += draw.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(now)
    return offsets
