"""The device engine's int8 x int8 -> int32 matrix products: torch._int_mm or a Triton kernel for
skinny products, whichever this GPU runs faster for each shape, chosen by timing.

A decoding step multiplies a few dozen activation rows (a graph bucket: 32, 64, ... rows) by every
weight of the model, so its GEMMs are bound by reading the int8 weights once. torch._int_mm hands
such shapes to cuBLASLt's Ampere-generation int8 kernels, tiled for square problems. The kernel
here is built for the skinny case: one program owns BLOCK_M rows and a BLOCK_N slice of output
columns and streams the weights' K dimension through BLOCK_K steps; when the columns alone make
too few programs to keep every multiprocessor reading, K is split over SPLIT_K programs whose
int32 partial sums are added atomically. On the H100 cuBLAS still won most shapes of the models
measured, and the choice keeps it there (docs/device-serving-h100.md, the 8B step).

Lossless whatever is chosen: each product is int8 x int8, summed in int32, which holds any sum of
K < 131,072 such products exactly (127 x 128 x K < 2^31), and integer addition is associative --
so every blocking, split and order of the atomic adds gives torch._int_mm's bits. The choice
changes speed only; Int8Gemm still checks each candidate's result against torch._int_mm's before
it may be chosen, so a kernel miscompiled on an untested GPU is never used.

Shapes: a [M, K] int8, row-major; w [K, N] int8, a column-major view (the transposed [N, K]
weight, as _int_mm reads it); out [M, N] int32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pardec.verifier.kernels.triton_layers import kernel


@dataclass(frozen=True)
class GemmConfig:
    """One tiling of the Triton kernel (block sizes are compile-time constants)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {value}")
        if self.block_k < 32:
            raise ValueError(f"GemmConfig.block_k must be >= 32 (int8 products), got {self.block_k}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"GemmConfig: split_k, num_warps and num_stages must be >= 1, got {self}")

    def text(self) -> str:
        return f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"


def candidates(rows: int) -> list[GemmConfig]:
    """The tilings timed for a product of `rows` rows: all rows in one block up to 64, then blocks
    of 64; columns and K steps that keep 16-32 KiB of weights in flight per program; split K for
    the narrow products (a 4096-column product in blocks of 64 is 64 programs on 132 SMs)."""
    block_m = max(16, min(64, triton.next_power_of_2(rows)))
    tilings = [(64, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 4, 4), (32, 256, 1, 4, 4),
               (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (128, 128, 2, 8, 4), (32, 512, 1, 4, 3)]
    return [GemmConfig(block_m, n, k, split, warps, stages) for n, k, split, warps, stages in tilings]


@kernel
def _int8_gemm(a, w, out, M, N, K, a_row, w_col, out_row,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
               EVEN_K: tl.constexpr):
    """out[rows, cols] (+)= a[rows, K-span] @ w[K-span, cols]; program (column block, row block,
    K split). K contiguous in both operands."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K steps of this program
    k0 = tl.program_id(2) * steps * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows[:, None] < M, cols[None, :] < N
    a_at = a + rows[:, None] * a_row + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_at = w + cols[None, :] * w_col + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for step in range(0, steps):
        if EVEN_K:
            x = tl.load(a_at, mask=row_ok, other=0)
            y = tl.load(w_at, mask=col_ok, other=0)
        else:  # zeros past K add nothing
            k_ok = (ks + step * BLOCK_K) < K
            x = tl.load(a_at, mask=row_ok & k_ok[None, :], other=0)
            y = tl.load(w_at, mask=col_ok & k_ok[:, None], other=0)
        acc = tl.dot(x, y, acc=acc, out_dtype=tl.int32)
        a_at += BLOCK_K
        w_at += BLOCK_K
    at = out + rows[:, None] * out_row + cols[None, :]
    if SPLIT_K == 1:
        tl.store(at, acc, mask=row_ok & col_ok)
    else:
        tl.atomic_add(at, acc, mask=row_ok & col_ok)


def matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GemmConfig) -> None:
    """out = a @ w in int32 through the Triton kernel tiled by `config`."""
    (M, K), N = a.shape, w.shape[1]
    if a.stride(1) != 1 or w.stride(0) != 1 or out.stride(1) != 1 or w.shape[0] != K or out.shape != (M, N):
        raise ValueError(f"int8 matmul: a [M, K] row-major, w [K, N] column-major and out [M, N] row-major, got "
                         f"a {tuple(a.shape)}/{a.stride()}, w {tuple(w.shape)}/{w.stride()}, out {tuple(out.shape)}")
    if K >= 131072:
        raise ValueError(f"int8 matmul: K must be < 131072 for exact int32 sums, got {K}")
    if not M:
        return
    if config.split_k > 1:
        out.zero_()
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(M, config.block_m), config.split_k)
    _int8_gemm.launch(grid, a, w, out, M, N, K, a.stride(0), w.stride(1), out.stride(0),
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      SPLIT_K=config.split_k, EVEN_K=K % (config.block_k * config.split_k) == 0,
                      num_warps=config.num_warps, num_stages=config.num_stages)


# What the device engine multiplies with: "auto" (time torch._int_mm and the candidates per shape
# on the GPU, keep the fastest that is exact), "cublas" (torch._int_mm always) or one GemmConfig's
# text ("m32n64k256s1w4p4": that tiling always, on every shape). Read when an engine is built.
GEMM = "auto"


def parse_gemm(text: str) -> str | GemmConfig:
    """'auto' | 'cublas' | a GemmConfig's text -> what Int8Gemm takes, checked."""
    if text in ("auto", "cublas"):
        return text
    import re

    match = re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)", text)
    if not match:
        raise ValueError(f"gemm: expected 'auto', 'cublas' or a tiling like 'm32n64k256s1w4p4', got {text!r}")
    return GemmConfig(*map(int, match.groups()))


class Int8Gemm:
    """out = a @ w (int8 -> int32) by whichever of torch._int_mm and the Triton tilings `choice`
    allows and this GPU runs fastest, decided once per (M, K, N) on the first eager product of
    that shape (a graph capture replays what the eager run before it chose)."""

    def __init__(self, choice: str | GemmConfig = "auto", repeats: int = 8):
        self.choice, self.repeats = choice, repeats
        self.chosen: dict[tuple[int, int, int], GemmConfig | None] = {}  # None: torch._int_mm
        self.timings: dict[tuple[int, int, int], dict[str, float]] = {}  # microseconds, per candidate
        self._flush: torch.Tensor | None = None

    def __call__(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        key = (a.shape[0], a.shape[1], w.shape[1])
        if not a.shape[0]:  # a step none of whose rows is scored: nothing to multiply
            return
        if key not in self.chosen:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                torch._int_mm(a, w, out=out)  # no timing inside a capture: the library's product
                return
            self.chosen[key] = self._choose(a, w, out)
        config = self.chosen[key]
        if config is None:
            torch._int_mm(a, w, out=out)
        else:
            matmul(a, w, out, config)

    def _choose(self, a, w, out) -> GemmConfig | None:
        if self.choice == "cublas":
            return None
        if isinstance(self.choice, GemmConfig):
            return self.choice
        if a.device.type != "cuda":  # under the interpreter timing means nothing: the library's product
            return None
        expected = torch._int_mm(a, w)
        timed: dict[str, float] = {"cublas": self._time(lambda: torch._int_mm(a, w, out=out))}
        best, best_us = None, timed["cublas"]
        for config in candidates(a.shape[0]):
            try:
                matmul(a, w, out, config)
            except Exception as error:  # a tiling this GPU cannot compile (shared memory, say) is skipped
                warnings.warn(f"int8 GEMM tiling {config.text()} failed on {tuple(a.shape)} x {tuple(w.shape)}: "
                              f"{error!r}", stacklevel=2)
                timed[config.text()] = float("nan")
                continue
            if not torch.equal(out, expected):  # never on a correct compiler: the sums are exact
                timed[config.text()] = float("nan")
                continue
            timed[config.text()] = us = self._time(lambda config=config: matmul(a, w, out, config))
            if us < best_us:
                best, best_us = config, us
        out.copy_(expected)
        self.timings[(a.shape[0], a.shape[1], w.shape[1])] = {k: round(v, 2) for k, v in timed.items()}
        return best

    def _time(self, product) -> float:
        """Median microseconds of `product` with the L2 cache flushed before each run, as a step
        finds a layer's weights (they never fit beside the rest of the model)."""
        if self._flush is None:
            self._flush = torch.empty(128 * 2**20, dtype=torch.int8, device="cuda")
        product()  # compiles
        runs = []
        for _ in range(self.repeats):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            product()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3)
        return sorted(runs)[len(runs) // 2]
