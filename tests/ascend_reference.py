"""CPU references of the torch-npu ops the verifier's NPU path calls, written from torch-npu's
documentation, in a module object that stands in for `torch_npu` in the tests only; and a stand-in
for `torch.npu`'s device queries."""

from __future__ import annotations

import types

import torch


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """int8 x1 [T, K] @ int8 x2 [K, N]; with output_dtype=torch.int32 the raw int32 sums, where the
    documentation gives no per-token scale (the only mode the verifier uses and this covers)."""
    if output_dtype is not torch.int32:
        raise NotImplementedError("the reference covers output_dtype=torch.int32 only")
    if pertoken_scale is not None or offset is not None or bias is not None:
        raise RuntimeError("npu_quant_matmul: no pertoken_scale, offset or bias with int32 output")
    if x1.dtype != torch.int8 or x2.dtype != torch.int8 or x1.shape[1] != x2.shape[0]:
        raise TypeError(f"int8 [T, K] and [K, N] expected, got {x1.dtype} {tuple(x1.shape)}, {x2.dtype} {tuple(x2.shape)}")
    if scale.dtype != torch.float32 or scale.numel() not in (1, x2.shape[1]):
        raise TypeError(f"scale: fp32 [1] or [{x2.shape[1]}] expected, got {scale.dtype} {tuple(scale.shape)}")
    sums = x1.long() @ x2.long()
    if sums.abs().max() >= 2**31:
        raise OverflowError("int32 sums overflow")
    return sums.to(torch.int32)


def npu_dynamic_quant(input, *, smooth_scales=None):
    """Symmetric per-token int8: scale = max|x| / 127 per row, output = round(x / scale) as int8;
    returns (output, fp32 scale of the shape of input without its last dimension). An all-zero
    row, which the documentation leaves open, comes out as zeros with scale 0."""
    x = input if smooth_scales is None else input * smooth_scales
    scale = x.abs().amax(dim=-1) / 127
    values = torch.where(scale[..., None] > 0, x / scale[..., None], 0.0).round().clamp(-128, 127)
    return values.to(torch.int8), scale.float()


def reference_torch_npu(without: str | None = None, **replaced) -> types.ModuleType:
    """A `torch_npu` module of the references, `without` one of its functions, or some replaced."""
    module = types.ModuleType("torch_npu")
    module.__version__ = "reference"
    functions = {"npu_quant_matmul": npu_quant_matmul, "npu_dynamic_quant": npu_dynamic_quant, **replaced}
    for name, function in functions.items():
        if name != without:
            setattr(module, name, function)
    return module


class NpuQueries:
    """What `torch.npu` answers about the host's NPUs: `count` cards named `name`."""

    def __init__(self, name: str = "Ascend910B3", count: int = 2, available: bool = True):
        self.name, self.count, self.available = name, count, available

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count

    def get_device_name(self, index: int = 0) -> str:
        return self.name
