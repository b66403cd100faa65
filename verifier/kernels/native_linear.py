"""W8A8 linear layers on CPU in one C call: int8_linear.c, built at first use (native_build.py).

torch._int_mm on CPU gets its int8 weights in plain [K, N] form at every call and was measured
at about twice the time that reading the weight bytes from memory takes; the activation
quantization and the scales around it are ~8 more torch ops per layer. This kernel
keeps the weights packed once, at load, in the operand layout of AVX512-VNNI's u8 x s8 dot product,
and quantizes, multiplies and scales in one pass. Its results are the torch path's bits (the
quantization and scaling take the same IEEE steps; the sums are exact integers), so the kernel can
be chosen by speed alone (quant.choose_kernel). Without AVX512-VNNI it runs on AVX2, from the same
vectors with each block of 16 channels in one contiguous run (pack's blocks_contiguous; exact too:
see int8_linear.c; several times faster there than fp32_exact and torch._int_mm, figures in
docs/benchmarks.md), and without either as portable integer C.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pardec.verifier.kernels import native_build

# decoder_layer.c (the per-row glue and a whole layer in one call) is linked in: it calls w8a8_linear.
SOURCES = (Path(__file__).with_name("int8_linear.c"), Path(__file__).with_name("decoder_layer.c"))
# -ffp-contract=off: the scaling must round like torch's separate multiplies and add (no FMA).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
CHANNELS = 16  # output channels per packed block
TILE_CHANNELS = 64  # channels per GEMM pass (int8_linear.c's BLOCK_TILE blocks): packed N is padded to it
INPUTS_PER_LANE = 4  # inputs summed per int32 lane by one dot-product instruction
# Added to every int8 activation to make it the u8 operand; each channel's sum is corrected back.
OFFSET = 128

_VOID = ctypes.c_void_p
_I64 = ctypes.c_int64




def pack(weight: torch.Tensor, blocks_contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """int8 weight [N, K] -> (packed int8 [N' / 64, K' / 4, 4, 16, 4], correction int32 [N], K').

    N' and K' are N and K rounded up to multiples of 64 and 4 (zero weights past them).
    packed[t, g, b, c, j] = weight[64 t + 16 b + c, 4 g + j]: each 64-channel tile is one stream,
    four 64-byte vectors per group of 4 inputs. With blocks_contiguous (the layout an AVX2 build
    reads) the indices mean the same but the memory runs [t, b, g, c, j]: each block of 16 channels
    is one stream over the groups, and `packed` is a permuted view of it. correction[n] =
    128 * sum_k weight[n, k], subtracted from the u8 x s8 sums.

    >>> packed, correction, k_padded = pack(torch.arange(-80, 80, dtype=torch.int8).reshape(16, 10))
    >>> packed.shape, k_padded, packed[0, 2, 0, 1].tolist(), correction[:2].tolist()
    (torch.Size([1, 3, 4, 16, 4]), 12, [-62, -61, 0, 0], [-96640, -83840])
    >>> contiguous_blocks, _, _ = pack(torch.arange(-80, 80, dtype=torch.int8).reshape(16, 10), True)
    >>> torch.equal(contiguous_blocks, packed), contiguous_blocks.stride()[:3], packed.stride()[:3]
    (True, (768, 64, 192), (768, 256, 64))
    """
    out_features, in_features = weight.shape
    if weight.dtype != torch.int8:
        raise ValueError(f"pack needs int8 weights, got {weight.dtype}")
    k_padded = -(-in_features // INPUTS_PER_LANE) * INPUTS_PER_LANE
    n_padded = -(-out_features // TILE_CHANNELS) * TILE_CHANNELS
    padded = weight.contiguous() if (n_padded, k_padded) == (out_features, in_features) else torch.nn.functional.pad(
        weight, (0, k_padded - in_features, 0, n_padded - out_features))  # pad copies even when it adds nothing
    packed = padded.reshape(n_padded // TILE_CHANNELS, TILE_CHANNELS // CHANNELS, CHANNELS,
                            k_padded // INPUTS_PER_LANE, INPUTS_PER_LANE)  # [t, b, c, g, j]
    if blocks_contiguous:
        packed = packed.permute(0, 1, 3, 2, 4).contiguous().permute(0, 2, 1, 3, 4)
    else:
        packed = packed.permute(0, 3, 1, 2, 4).contiguous()
    # By blocks of rows widened into one reused buffer: a sum with an int32 dtype converts its whole
    # input first (4x an LM head), and a new conversion per block left the freed ones scattered
    # over the heap, most of a gigabyte held after a large head's pack.
    correction = torch.empty(out_features, dtype=torch.int32)
    widened = torch.empty(min(out_features, 4096), in_features, dtype=torch.int32)
    for start in range(0, out_features, 4096):
        block = widened[:min(4096, out_features - start)].copy_(weight[start:start + 4096])
        torch.sum(block, 1, out=correction[start:start + len(block)])
    correction *= OFFSET
    return packed, correction, k_padded


def is_blocks_contiguous(packed: torch.Tensor) -> bool:
    """Which of pack's two memory layouts `packed` is in (with one group they are the same bytes)."""
    return packed.shape[1] == 1 or packed.stride(1) == CHANNELS * INPUTS_PER_LANE


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """pack's inverse: int8 [N, K]."""
    tiles, groups = packed.shape[:2]
    return packed.permute(0, 2, 3, 1, 4).reshape(tiles * TILE_CHANNELS, groups * INPUTS_PER_LANE)[
        :out_features, :in_features]


class NativeLinear:
    """The loaded kernel: `forward` is one W8A8 linear layer over fp32 or fp64 rows."""

    def __init__(self, library: Path):
        self._lib = ctypes.CDLL(str(library))
        fn = self._lib.w8a8_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [_VOID, ctypes.c_int, _I64, _I64, _I64, _VOID, _VOID, _VOID, _VOID, _I64, _VOID, _VOID, _VOID,
                       _I64, ctypes.c_int]
        self._fn = fn
        self._lib.w8a8_blocks_contiguous.restype = ctypes.c_int
        # The packed layout this build reads: pack() with this, or forward() refuses the weights.
        self.blocks_contiguous = bool(self._lib.w8a8_blocks_contiguous())
        self._lib.w8a8_amx.restype = ctypes.c_int
        # True when 9+ rows multiply on AMX tiles (a CPU with AMX-INT8 whose kernel grants the state).
        self.uses_amx = bool(self._lib.w8a8_amx())
        for name in ("rms_norm", "silu_mul"):
            getattr(self._lib, name).restype = None
        self._lib.rms_norm.argtypes = [_VOID, _VOID, _I64, _I64, ctypes.c_float, _VOID, ctypes.c_int]
        self._lib.silu_mul.argtypes = [_VOID, _I64, _I64, _VOID, ctypes.c_int]
        self.decoder_layer = self._lib.decoder_layer  # typed by native_layers.py

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`pack` in the layout this build reads."""
        return pack(weight, self.blocks_contiguous)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, dim] fp32 -> x / sqrt(mean(x^2) + eps) * weight, row by row (decoder_layer.c)."""
        x = _cpu_float_rows(x, weight.numel())
        out = torch.empty_like(x)
        self._lib.rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(),
                           torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * width] fp32 -> silu(gate) * up [T, width], gate and up its two halves."""
        gate_up = _cpu_float_rows(gate_up, gate_up.shape[-1])
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=torch.float32)
        self._lib.silu_mul(gate_up.data_ptr(), rows, width, out.data_ptr(), torch.get_num_threads())
        return out

    def forward(self, x: torch.Tensor, packed: torch.Tensor, correction: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, input_hadamard: int = 0) -> torch.Tensor:
        """x [T, K] fp32 or fp64 -> fp32 [T, N], N = weight_scale's length; with input_hadamard, each
        fp32 row goes through quant.block_hadamard first, fused into the quantization."""
        if x.dtype not in (torch.float32, torch.float64) or x.device.type != "cpu":
            raise ValueError(f"the native W8A8 kernel takes fp32 or fp64 CPU rows, got {x.dtype} on {x.device}")
        if packed.shape[1] > 1 and is_blocks_contiguous(packed) != self.blocks_contiguous:
            raise ValueError("these weights were packed for the other layout: pack them with this kernel's pack()")
        x = x.contiguous()
        rows, in_features = x.shape
        out_features = weight_scale.numel()
        k_padded = packed.shape[1] * INPUTS_PER_LANE
        out = torch.empty(rows, out_features, dtype=torch.float32)
        quantized = torch.empty(rows, k_padded, dtype=torch.uint8)
        row_scales = torch.empty(rows, dtype=torch.float32)
        status = self._fn(
            x.data_ptr(), int(x.dtype == torch.float64), rows, in_features, k_padded, packed.data_ptr(),
            correction.data_ptr(), weight_scale.data_ptr(), None if bias is None else bias.data_ptr(), out_features,
            out.data_ptr(), quantized.data_ptr(), row_scales.data_ptr(), input_hadamard, torch.get_num_threads(),
        )
        if status == 2:
            raise MemoryError("w8a8_linear: out of memory for its scratch rows")
        if status != 0:
            raise ValueError(f"w8a8_linear rejected the shapes: K {in_features} (packed {k_padded}), N {out_features}, "
                             f"{x.dtype} rows with input_hadamard {input_hadamard}")
        return out


def _cpu_float_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"expected fp32 CPU rows of {width}, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous()


@functools.cache  # one library handle per process, shared by every layer
def load(cache_dir: Path | None = None) -> NativeLinear | None:
    library = native_build.build(SOURCES, FLAGS, cache_dir)
    return NativeLinear(library) if library is not None else None
