"""Static W8A8 linear layers: msModelSlim's "W8A8" (verifier/model/msmodelslim.py), used as stored.

Each layer carries, per output channel c, int8 weights W[c, :], an int32 `quant_bias[c]` and an
fp32 `deq_scale[c]`, and for its whole input one activation scale s and one integer offset o:

    q[k]   = clamp(round(x[k] * r) + o, -128, 127)      r = fp32(1 / s), round half to even
    acc[c] = sum_k q[k] * W[c, k] + quant_bias[c]        exact integer arithmetic
    y[c]   = fp32(acc[c]) * deq_scale[c]                 one fp32 rounding, then one fp32 product

msModelSlim writes quant_bias = round(bias / deq_scale - o * sum_k W[c, k]): the offset's share and
the float bias (a Qwen2 q/k/v bias, an anti-outlier correction) are folded in, so the stored
`bias` tensor of such a layer is not added again. Its formula rounds x / s + o in one step; o is an
integer, so that is round(x / s) + o exactly, which is what is computed here (an fp32 sum x / s + o
could round a value next to .5 across it). Multiplying by the reciprocal is what vLLM Ascend's
npu_quantize call does; the NPU computes in fp16 / bf16 and rounds otherwise, so this is the
checkpoint's arithmetic in our own exact form, not the NPU's bits.

Why a row's output does not depend on its batch (what tree verification needs, see quant.py):
every step above uses only the row itself and constants stored in the checkpoint. Unlike the
dynamic W8A8 of quant.py there is not even a per-row max: q is an elementwise function of x, the
integer sum is exact in any order (int32 with torch._int_mm / npu_quant_matmul; with fp32_exact
each chunk of at most 1024 products is an integer of magnitude at most 1024 * 128 * 128 = 2**24,
held exactly by fp32, and the chunks and quant_bias are added in float64, exact below 2**53), and
the dequantization is two elementwise roundings of that exact integer. So any kernel, batch size,
blocking or thread count gives the same bits for the same row; `tests/test_msmodelslim.py` checks
it against a plain numpy evaluation of the formulas above.

The CPU "native" C kernel quantizes each row dynamically inside its GEMM, so a static layer in a
model whose kernel is "native" runs the exact torch path ("fp32_exact") instead.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pardec.verifier.model.quant import _MATMULS, MAX_EXACT_CHUNK

INT8_MIN, INT8_MAX = -128, 127


def decode_deq_scale(stored: torch.Tensor, name: str) -> torch.Tensor:
    """msModelSlim's deq_scale as fp32: stored as float32 (bf16 models), or (fp16 models) as int64
    holding the fp32 bit pattern read as an int32 and widened (np.frombuffer(..., int32).astype(int64)),
    which is what Ascend's quantized matmul takes as its uint64 scale."""
    if stored.dtype == torch.int64:
        values = stored.flatten().numpy()
        if values.size and (values.min() < -(2**31) or values.max() >= 2**32):
            raise ValueError(f"{name}: int64 deq_scale with bits above the low 32 (not an fp32 bit pattern)")
        return torch.from_numpy((values & 0xFFFFFFFF).astype(np.uint32).view(np.float32).copy())
    if stored.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return stored.float().flatten()
    raise ValueError(f"{name}: deq_scale of dtype {stored.dtype}; msModelSlim stores int64 or float32")


def input_quantization(tensors, prefix: str) -> tuple[float, float]:
    """(scale, offset) of a static layer's activations, as fp32 values."""
    return (float(tensors[f"{prefix}.input_scale"].float().reshape(-1)[0]),
            float(tensors[f"{prefix}.input_offset"].float().reshape(-1)[0]))


def dequantized(tensors, prefixes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float function of static layers (stacked by output): weight W * deq_scale / s and bias
    (quant_bias + o * sum_k W) * deq_scale, what the checkpoint computes before activation rounding.
    The float model ("none") of an msModelSlim checkpoint is built from these."""
    weights, biases = [], []
    for prefix in prefixes:
        scale, offset = input_quantization(tensors, prefix)
        weight = tensors[f"{prefix}.weight"].double()
        deq = tensors[f"{prefix}.deq_scale"].double()
        weights.append(weight * (deq / scale)[:, None])
        biases.append((tensors[f"{prefix}.quant_bias"].double() + offset * weight.sum(dim=1)) * deq)
    return torch.cat(weights).float(), torch.cat(biases).float()


class StaticW8A8Linear(nn.Module):
    """y = fp32(x_q @ W^T + quant_bias) * deq_scale with a per-tensor static activation scale and
    offset (see the module's docstring for the arithmetic and why it is batch invariant)."""

    def __init__(self, weight: torch.Tensor, quant_bias: torch.Tensor, deq_scale: torch.Tensor,
                 input_scale: float, input_offset: float, kernel: str = "fp32_exact", ascend=None):
        """ascend: the Ascend ops (ascend.AscendOps) for the npu_quant_matmul kernel."""
        super().__init__()
        if weight.dtype != torch.int8:
            raise ValueError(f"a static W8A8 weight must be int8, got {weight.dtype}")
        if input_offset != round(input_offset) or not INT8_MIN <= input_offset <= INT8_MAX:
            raise ValueError(f"input_offset must be an integer in [-128, 127], got {input_offset}")
        if not input_scale > 0 or not np.isfinite(input_scale):
            raise ValueError(f"input_scale must be positive and finite, got {input_scale}")
        out_features, in_features = weight.shape
        if (kernel == "npu_quant_matmul") != (ascend is not None):
            raise ValueError("the npu_quant_matmul kernel, and it only, runs on the Ascend ops (ascend.startup_ops)")
        self.ascend = ascend
        self.kernel = kernel if kernel in _MATMULS or ascend is not None else "fp32_exact"
        self.in_features, self.out_features = in_features, out_features
        reciprocal = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(input_scale, dtype=torch.float32)
        self.register_buffer("input_reciprocal", reciprocal)
        self.input_offset = float(input_offset)
        self.register_buffer("quant_bias", quant_bias.to(torch.int32).reshape(out_features).clone())
        self.register_buffer("deq_scale", deq_scale.float().reshape(out_features).clone())
        if ascend is not None:
            self.chunk_bounds = [(0, in_features)]
            chunks = [weight.t().contiguous()]  # int8 [in, out] row-major, as quant.py keeps it for the NPU
            self.register_buffer("neutral_scale", torch.ones(out_features), persistent=False)
        elif self.kernel in _MATMULS:
            self.chunk_bounds = [(0, in_features)]
            chunks = [weight.contiguous().t()]  # int8 [in, out], a transposed view as quant.py keeps it
        else:
            n_chunks = -(-in_features // MAX_EXACT_CHUNK)
            chunk = -(-in_features // n_chunks)
            self.chunk_bounds = [(start, min(start + chunk, in_features)) for start in range(0, in_features, chunk)]
            chunks = [weight[:, start:end].float().t().contiguous() for start, end in self.chunk_bounds]
        self.weight_chunks = nn.ParameterList(nn.Parameter(chunk, requires_grad=False) for chunk in chunks)

    @classmethod
    def from_tensors(cls, tensors, prefixes: list[str], kernel: str, ascend=None) -> "StaticW8A8Linear":
        """One layer for `prefixes` stacked by output (q/k/v, gate/up), which must share their
        input's scale and offset: they read the same activation row."""
        scale, offset = input_quantization(tensors, prefixes[0])
        return cls(torch.cat([tensors[f"{p}.weight"] for p in prefixes]),
                   torch.cat([tensors[f"{p}.quant_bias"].flatten() for p in prefixes]),
                   torch.cat([tensors[f"{p}.deq_scale"].flatten() for p in prefixes]), scale, offset, kernel, ascend)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """int8 values (as x's float dtype) of the rows x [T, in], fp32 or fp64."""
        values = x.mul(self.input_reciprocal.to(x.dtype)).round_()
        return values.add_(self.input_offset).clamp_(INT8_MIN, INT8_MAX)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = self.quantize_input(x)
        if self.ascend is not None:
            sums = self.ascend.int8_matmul(values.to(torch.int8), self.weight_chunks[0], self.neutral_scale)
            exact = sums.add_(self.quant_bias)
        elif self.kernel in _MATMULS:
            sums = _MATMULS[self.kernel](values.to(torch.int8), self.weight_chunks[0])
            exact = sums.add_(self.quant_bias)  # int32: |sum| < in * 2**14 + |quant_bias|
        else:
            values = values.float()
            exact = self.quant_bias.double().expand(x.shape[0], -1).clone()
            for (start, end), chunk in zip(self.chunk_bounds, self.weight_chunks):
                exact.add_((values[:, start:end] @ chunk).double())
        return exact.float().mul_(self.deq_scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}, "
                f"static input scale 1/{float(1 / self.input_reciprocal):.6g}, offset {self.input_offset:g}")


class StackedLinears(nn.Module):
    """Layers that read the same input row, their outputs side by side: what a fused q/k/v or
    gate/up becomes when its parts cannot be one layer (another kind, or other static scales).
    Each part is row-wise, so the concatenation is too."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = None  # the device engine's and fused C path's checks read these
        self.input_hadamard = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
