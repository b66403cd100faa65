"""W8A8 linear layers whose output rows do not depend on the batch they are computed in.

Tree verification is lossless only if a token's logits are bit-identical whether it is computed
alone or next to other tree nodes. A float GEMM does not give that: BLAS picks kernels and blockings
by shape, so the same row summed in another order rounds differently. Integer arithmetic does:

  * weights are int8, symmetric, one scale per output channel (quantized once, at load);
  * activations are int8, symmetric, one scale per row (token), computed from that row alone;
  * the int8 x int8 products are summed by an fp32 GEMM over integer-valued fp32 tensors. Every
    product and every partial sum is an integer below 2**24, which fp32 holds exactly, so the sum is
    the same whatever order or blocking the GEMM uses -- even if a backend rounds GEMM inputs to
    bf16 or TF32, because integers up to 127 are exact there too.

The bound is K * 127 * 127 < 2**24, i.e. K <= 1040. Longer reductions are cut into chunks of at most
1024 whose exact partial results are added in a fixed order, which is deterministic per row.

A second kernel, torch._int_mm (int8 x int8 -> int32), is exact by construction and keeps the
weights in int8 (4x less memory traffic). Whether it is exact *and* faster depends on the machine:
with AVX512-VNNI's int8 dot product it is several times faster than the fp32 emulation for
17..65 rows and on par for one row, while on AVX2 CPUs without VNNI it was measured over an
order of magnitude slower, and an int8 kernel built on AVX2's saturating vpmaddubsw is exact only
if it keeps each pair's sum in int16 (the native one does). So `choose_kernel` decides at load by
measurement, after checking exactness on extreme values.

On CPU a third kernel, "native" (native_linear.py), is C built for the machine at first use: int8
weights packed once for AVX512-VNNI, quantization, integer GEMM and scales in one call, with the
torch path's bits. Weights packed once and one call in place of torch._int_mm and its torch ops
make it faster at one row and at 16 rows alike, so it is the CPU choice where it builds and wins the measurement.
Without VNNI it runs on AVX2, where it still beats fp32_exact and torch._int_mm does not. The
measurements behind all three: docs/benchmarks.md, "Figures behind design choices".

On an Ascend NPU the int8 kernel is torch-npu's quantized matmul with int32 output
(`npu_quant_matmul`) and the rows are quantized by `npu_dynamic_quant`, both through the ops
object of ascend.py, which checks them at startup (this exactness probe included); the scales
are applied after the integer product, in fp32, as here.

Weights normally come in float and are quantized here; an int8 checkpoint (compressed-tensors,
verifier/weights.py) passes its int8 values and per-channel scales, used exactly as stored.
"""

import logging
import time

import torch
from torch import nn

from pardec.verifier.kernels import native_linear

log = logging.getLogger(__name__)

KERNELS = ("int_mm", "fp32_exact", "npu_quant_matmul", "native")
# Kernels that keep int8 weights and return int32 sums in one product (no K chunks).
_INT8_KERNELS = ("int_mm", "npu_quant_matmul")
# torch._int_mm on CUDA needs more than 16 rows; fewer are padded with zero rows (exact, per row).
_CUDA_MIN_ROWS = 17

INT8_MAX = 127
# Longest reduction per GEMM: under 1040, where partial sums of int8 x int8 products reach 2**24.
MAX_EXACT_CHUNK = 1024


def block_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., n] times blockdiag(H, H, ...) for Sylvester's unnormalized Hadamard matrix H of size
    `block` (a power of two dividing n), by the fast Walsh-Hadamard butterflies: log2(block)
    stages of (a, b) -> (a + b, a - b) on elements `half` apart. Only elementwise adds and
    subtracts, so a row's result does not depend on the other rows (batch invariant), and
    int8_linear.c's fused version takes the same steps in the same order: the same bits.

    >>> block_hadamard(torch.tensor([[1.0, 2.0, 3.0, 4.0, 1.0, 0.0, 0.0, 0.0]]), 4)
    tensor([[10., -2., -4.,  0.,  1.,  1.,  1.,  1.]])
    """
    shape, n = x.shape, x.shape[-1]
    if block & (block - 1) or n % block:
        raise ValueError(f"block must be a power of two dividing {n}, got {block}")
    rows = x.reshape(-1, n // block, block)
    half = 1
    while half < block:
        pairs = rows.reshape(rows.shape[0], n // block, block // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        rows = torch.stack([first + second, first - second], dim=-2).reshape(rows.shape)
        half *= 2
    return rows.reshape(shape)


def quantize_weight(weight: torch.Tensor, rows_at_once: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of a float weight [out, in]: (int8 [out, in], fp32 scale
    [out]), made a slice of rows at a time: a large vocabulary's head widened to fp32 is most of a
    gigabyte, and each whole-matrix step would make another (each row's numbers are its own, so
    the slices change none).

    >>> values, scale = quantize_weight(torch.tensor([[1.0, -0.25], [0.0, 0.0], [0.5, -2.0]]), rows_at_once=2)
    >>> values.tolist(), [round(s * 127, 4) for s in scale.tolist()]
    ([[127, -32], [0, 0], [32, -127]], [1.0, 127.0, 2.0])
    """
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    # One fp32 buffer for every slice, worked in place: new temporaries per slice were left
    # scattered over the heap once freed.
    buffer = torch.empty(min(rows_at_once, weight.shape[0]), weight.shape[1], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_at_once):
        rows = buffer[:min(rows_at_once, weight.shape[0] - start)].copy_(weight[start:start + rows_at_once])
        scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()) / INT8_MAX  # max |w|, without |w|
        # An all-zero row quantizes to zeros under any scale; 1 keeps the division finite.
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        values[start:start + len(rows)] = rows.div_(scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX)
        scales[start:start + len(rows)] = scale
    return values, scales


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of fp32 or fp64 `x` [T, K]: (integer-valued fp32 [T, K], fp32 scale [T, 1]).

    fp64 input (the attention output) is quantized directly rather than rounded to fp32 first. Its
    last-bit noise from summation order is ~1e-16 relative, so it almost never crosses an fp32
    rounding boundary of the scale or a rounding boundary of the int8 values, and the quantized row
    comes out the same whatever else was in the batch.
    """
    # The max-abs of a row is exact in any order; the floor keeps an all-zero row finite (it stays 0).
    # abs().amax() rather than vector_norm(inf): the same value, and on CPU over an order of
    # magnitude faster; vector_norm(inf) was a noticeable share of a long prefill (figures:
    # docs/benchmarks.md).
    scale = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).float()
    scale.clamp_min_(torch.finfo(torch.float32).tiny)
    values = x.div(scale.to(x.dtype)).round_().float()
    return values, scale


def _int_mm(x_int8: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """int8 [T, K] x int8 [K, N] -> int32 [T, N], padding short inputs on CUDA."""
    rows = x_int8.shape[0]
    if x_int8.is_cuda and rows < _CUDA_MIN_ROWS:
        x_int8 = torch.cat([x_int8, x_int8.new_zeros(_CUDA_MIN_ROWS - rows, x_int8.shape[1])])
        return torch._int_mm(x_int8, weight)[:rows]
    return torch._int_mm(x_int8, weight)


# The int8 products by kernel name; npu_quant_matmul is ascend.AscendOps.int8_matmul, held by
# the layers that use it.
_MATMULS = {"int_mm": _int_mm}


def int_mm_is_exact(device: torch.device | str) -> bool:
    """True when torch._int_mm runs on ``device`` and reproduces exact int64 results."""
    return kernel_is_exact("int_mm", device)


def kernel_is_exact(kernel: str, device: torch.device | str) -> bool:
    """True when the int8 kernel ``kernel`` ("int_mm") is exact on ``device``: int8_matmul_is_exact."""
    return int8_matmul_is_exact(_MATMULS[kernel], device, kernel)


def int8_matmul_is_exact(matmul, device: torch.device | str, name: str) -> bool:
    """True when ``matmul`` (int8 [T, K], int8 [K, N] -> int32 [T, N]) runs on ``device`` and
    reproduces exact int64 results on saturating inputs (all +-127, alternating signs; sums
    beyond 2**24, so a pass through fp32 anywhere would show) and on random ones."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    probes = [
        (torch.full((17, 1536), 127, dtype=torch.int8), torch.full((1536, 576), -127, dtype=torch.int8)),
        (torch.tensor([[127, -127] * 288] * 17, dtype=torch.int8), torch.tensor([[127] * 64, [-127] * 64] * 288, dtype=torch.int8)),
        (torch.randint(-127, 128, (17, 576), generator=generator, dtype=torch.int8),
         torch.randint(-127, 128, (576, 1536), generator=generator, dtype=torch.int8)),
    ]
    try:
        return all(
            torch.equal(matmul(a.to(device), b.to(device)).cpu().long(), a.long() @ b.long()) for a, b in probes
        )
    except (RuntimeError, ImportError, TypeError) as error:
        log.info("%s unavailable on %s: %s", name, device, error)
        return False


def choose_kernel(device: torch.device | str) -> str:
    """The fastest exact kernel on this device, measured on a model shape: a W8A8 layer of
    576 x 1536 run on 1 and on 17 rows. Candidates: fp32_exact always; int_mm when exact here;
    native on CPU when it builds and passes the same exactness probe."""
    device = torch.device(device)
    if device.type == "npu":
        # torch._int_mm has no NPU kernel; torch-npu's quantized matmul is the int8 path there,
        # probed at startup by ascend.startup_ops, which refuses the device when it is not exact.
        return "npu_quant_matmul"
    candidates = ["fp32_exact"]
    if int_mm_is_exact(device):
        candidates.append("int_mm")
    if device.type == "cpu" and native_is_exact():
        candidates.append("native")
    if len(candidates) == 1:
        log.info("W8A8 kernel: fp32_exact (no exact int8 kernel on %s)", device)
        return "fp32_exact"
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1536, 576, generator=generator)
    inputs = [torch.randn(rows, 576, generator=generator).to(device) for rows in (1, 17)]

    def seconds(layer: "W8A8Linear") -> float:
        # Best of several trials: the probe runs while other services start on the same cores.
        best = float("inf")
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                for x in inputs:
                    layer(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    timings = {kernel: seconds(W8A8Linear(weight, kernel=kernel).to(device)) for kernel in candidates}
    kernel = min(timings, key=timings.get)
    log.info("W8A8 kernel: %s (%s on the probe)", kernel,
             ", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in timings.items()))
    return kernel


def native_is_exact() -> bool:
    """True when the native kernel builds and reproduces exact integer results on the saturating
    and random probes of kernel_is_exact (rows scaled so their int8 values are the probe's own)."""
    if native_linear.load() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    probes = [
        (torch.full((17, 1536), 127, dtype=torch.int8), torch.full((1536, 576), -127, dtype=torch.int8)),
        (torch.tensor([[127, -127] * 288] * 17, dtype=torch.int8), torch.tensor([[127] * 64, [-127] * 64] * 288, dtype=torch.int8)),
        (torch.randint(-127, 128, (17, 576), generator=generator, dtype=torch.int8),
         torch.randint(-127, 128, (576, 1536), generator=generator, dtype=torch.int8)),
    ]
    for a, b in probes:
        a[:, 0] = 127  # every row's max-abs is 127: its scale is exactly 1 and its values are a's
        layer = W8A8Linear(b.t().contiguous(), kernel="native", weight_scale=torch.ones(b.shape[1]))
        if not torch.equal(layer(a.float()), (a.long() @ b.long()).float()):
            log.warning("the native W8A8 kernel is not exact on this machine; it is not used")
            return False
    return True


class W8A8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "fp32_exact",
                 weight_scale: torch.Tensor | None = None, input_hadamard: int = 0, ascend=None):
        """weight: float [out, in], quantized here; or, with weight_scale [out] (or [out, 1]),
        int8 values of an already-quantized checkpoint, used as they are. input_hadamard: the block
        of quant.block_hadamard applied to every input row before it is quantized (0: none).
        ascend: the Ascend ops (ascend.AscendOps), which the npu_quant_matmul kernel runs on."""
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if (kernel == "npu_quant_matmul") != (ascend is not None):
            raise ValueError("the npu_quant_matmul kernel, and it only, runs on the Ascend ops (ascend.startup_ops)")
        self.ascend = ascend
        out_features, in_features = weight.shape
        if weight_scale is None:
            values, scale = quantize_weight(weight)
        else:
            if weight.dtype != torch.int8:
                raise ValueError(f"a weight with a stored weight_scale must be int8, got {weight.dtype}")
            # -128 may appear in checkpoints (symmetric int8 is [-128, 127] there); exactness holds:
            # 1024 * 128 * 127 < 2**24 for the fp32 chunks, and far below 2**31 for int32.
            # Kept int8 (no fp32 copy of a large head while it loads); fp32_exact converts per chunk.
            values, scale = weight, weight_scale.float().reshape(out_features)
        self.kernel = kernel
        if input_hadamard and (input_hadamard & (input_hadamard - 1) or in_features % input_hadamard):
            raise ValueError(f"input_hadamard must be a power of two dividing {in_features}, got {input_hadamard}")
        self.input_hadamard = input_hadamard
        self.native = None
        if kernel == "native":
            self.native = native_linear.load()
            if self.native is None:
                raise RuntimeError("W8A8 kernel 'native' needs a C compiler (see native_build.py)")
            packed, correction, _ = self.native.pack(values.to(torch.int8))
            self.register_buffer("packed", packed)
            self.register_buffer("correction", correction)
            self.chunk_bounds = []
        elif kernel in _INT8_KERNELS:
            # int32 accumulation is exact for any K here (1536 * 127 * 127 < 2**31): no chunks.
            self.chunk_bounds = [(0, in_features)]
            dtype = torch.int8
        else:
            n_chunks = -(-in_features // MAX_EXACT_CHUNK)
            chunk = -(-in_features // n_chunks)
            self.chunk_bounds = [(start, min(start + chunk, in_features)) for start in range(0, in_features, chunk)]
            dtype = torch.float32
        # [in, out] slices. fp32: stored so, what MKL reads faster than [out, in] for a 1-row step
        # and the LM head's GEMV (17..65 rows: on par). int8: a transposed view of [out, in]
        # memory, what torch._int_mm reads fastest on CPU for 1-row GEMMs (16 rows and more: on
        # par). Figures: docs/benchmarks.md, "Figures behind design choices".
        # npu_quant_matmul: int8 [in, out] in plain row-major (ND) layout, as its documentation
        # describes x2.
        self.weight_chunks = nn.ParameterList(
            nn.Parameter(
                values.to(dtype).t().contiguous() if ascend is not None
                else values[:, start:end].contiguous().to(dtype).t() if dtype == torch.int8
                else values[:, start:end].t().contiguous().float(),
                requires_grad=False,
            )
            for start, end in self.chunk_bounds
        )
        if ascend is not None:  # npu_quant_matmul's scale argument: ones, the scales come after
            self.register_buffer("neutral_scale", torch.ones(out_features), persistent=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] fp32 or fp64 -> [T, out] fp32
        if self.native is not None:
            return self.native.forward(x, self.packed, self.correction, self.weight_scale, self.bias, self.input_hadamard)
        if self.input_hadamard:
            x = block_hadamard(x, self.input_hadamard)
        if self.ascend is not None:
            # The same arithmetic as below: exact int32 sums, then the row's and the channel's scales.
            x_int8, x_scale = self.ascend.quantize_rows(x)
            accumulator = self.ascend.int8_matmul(x_int8, self.weight_chunks[0], self.neutral_scale).float()
            out = accumulator.mul_(x_scale).mul_(self.weight_scale)
            return out if self.bias is None else out.add_(self.bias)
        x_values, x_scale = quantize_activation(x)
        if self.kernel in _INT8_KERNELS:
            accumulator = _MATMULS[self.kernel](x_values.to(torch.int8), self.weight_chunks[0]).float()
        else:
            accumulator = None
            for (start, end), weight_chunk in zip(self.chunk_bounds, self.weight_chunks):
                partial = x_values[:, start:end] @ weight_chunk
                accumulator = partial if accumulator is None else accumulator.add_(partial)
        out = accumulator.mul_(x_scale).mul_(self.weight_scale)
        return out if self.bias is None else out.add_(self.bias)

    def integer_weight(self) -> torch.Tensor:
        """The quantized weight's integer values, fp32 [out, in], whichever kernel holds them."""
        if self.native is not None:
            return native_linear.unpack(self.packed, self.out_features, self.in_features).float()
        return torch.cat([chunk.float() for chunk in self.weight_chunks]).t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel}, chunks={len(self.chunk_bounds)}, input_hadamard={self.input_hadamard}")
