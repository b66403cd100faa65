"""Tree attention on CPU in fp32 with a fixed reduction order: tree_attention.c, built at first use.

Batch invariance (a row's logits do not depend on what else is in its forward) needs every
reduction of a row to run in an order fixed by that row alone. torch's fp32 kernels do not promise
that (they block by shape), which is why attention.py computes in fp64, whose order noise is too
small to matter. The C kernel promises it by construction (see its header) and computes in fp32:
half the bytes and twice the SIMD lanes of fp64, no mask materialized per head, no fp64 copy of the
cache per layer. Its outputs differ from the fp64 path's in the last fp32 bits, so one engine uses
one of them for everything, plain decoding and verification alike.

The kernel is compiled for the machine it runs on (native_build.py), once per KV storage dtype:
fp32, or bf16 (half the cache's memory and reads; each stored number is rounded once, when it is
written, so a row's keys read back the same whatever else was stored, and the kernel computes
on them in fp32 as the fp32 build does). `load` returns None when there is no C compiler, and
the model then uses the fp64 path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from pardec.verifier.kernels import native_build

SOURCE = Path(__file__).with_name("tree_attention.c")
# --param=avoid-fma-max-bits=0: GCC tuned for AMD Zen (-march=native there) otherwise splits an
# FMA whose sum feeds the next one in a loop into a multiply and an add, in some loops and not in
# others, so a key's score would round differently by which loop scored it (tests caught it).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "--param=avoid-fma-max-bits=0", "-fno-math-errno",
         "-fopenmp", "-shared", "-fPIC")
# The kernel's vectors hold 16 fp32 lanes (8 without AVX-512), whole ones only: head_dim must be a multiple of 16.
LANES = 16
# The cache dtypes it reads, and the build flag of each.
KV_DTYPES = {torch.float32: (), torch.bfloat16: ("-DKV_BF16",)}

_I64 = ctypes.POINTER(ctypes.c_int64)
_F32 = ctypes.POINTER(ctypes.c_float)


@dataclass(frozen=True)
class Storage:
    """Where one layer's keys and values are: key d of kv head g at slot s is
    keys[g * head_stride + s * slot_stride + d], values alike."""

    keys: torch.Tensor
    values: torch.Tensor
    head_stride: int
    slot_stride: int


@dataclass(frozen=True)
class Layout:
    """A forward's segments (one per session step), as the kernel reads them; built once per forward."""

    starts: torch.Tensor  # int64 [segments]: committed positions before the step
    steps: torch.Tensor  # int64 [segments]: step rows
    first_rows: torch.Tensor  # int64 [segments]: first packed row
    slot_offsets: torch.Tensor  # int64 [segments]: where each segment's slots begin in `slots`
    slots: torch.Tensor  # int64: every segment's slot of positions [0, start + steps), concatenated
    ancestor_offsets: torch.Tensor  # int64 [rows + 1]: CSR row pointers into ancestor_columns
    ancestor_columns: torch.Tensor  # int64: each row's ancestors in the step (ascending, itself last)

    @classmethod
    def build(cls, starts: list[int], ancestors: list[torch.Tensor], slots: list[torch.Tensor]) -> "Layout":
        steps = [a.shape[0] for a in ancestors]
        pairs = torch.cat([a.nonzero() for a in ancestors]) if ancestors else torch.zeros(0, 2, dtype=torch.int64)
        per_row = torch.cat([a.sum(1) for a in ancestors])
        first_rows = torch.tensor([0] + steps[:-1]).cumsum(0)
        slot_lengths = torch.tensor([0] + [s.numel() for s in slots[:-1]])
        return cls(
            starts=torch.tensor(starts, dtype=torch.int64),
            steps=torch.tensor(steps, dtype=torch.int64),
            first_rows=first_rows,
            slot_offsets=slot_lengths.cumsum(0),
            slots=torch.cat(slots).to(torch.int64).contiguous(),
            ancestor_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), per_row.cumsum(0)]),
            ancestor_columns=pairs[:, 1].contiguous(),
        )

    def segment(self, index: int) -> "Layout":
        """The same forward with only segment `index` (row pointers stay global)."""
        pick = slice(index, index + 1)
        return Layout(self.starts[pick], self.steps[pick], self.first_rows[pick], self.slot_offsets[pick],
                      self.slots, self.ancestor_offsets, self.ancestor_columns)


class NativeAttention:
    """The loaded kernel: `attend` runs one layer's attention for every segment of a forward."""

    def __init__(self, library: Path, kv_dtype: torch.dtype = torch.float32):
        self.kv_dtype = kv_dtype  # what the cache it reads stores
        self._lib = ctypes.CDLL(str(library))
        fn = self._lib.tree_attention
        fn.restype = ctypes.c_int
        fn.argtypes = ([_F32, _F32] + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
                       + [ctypes.c_int64] * 3 + [_I64] * 7 + [ctypes.c_int])
        self._fn = fn

    @property
    def address(self) -> int:
        """tree_attention's address, for C callers (decoder_layer.c)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def attend(self, queries: torch.Tensor, storage: Storage, layout: Layout, n_kv_heads: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """queries [rows, n_heads, head_dim] fp32 (rotated) -> fp32 [rows, n_heads * head_dim]: the
        rows of `layout`'s segments, written into `out` when given."""
        rows, n_heads, head_dim = queries.shape
        if head_dim % LANES:
            raise ValueError(f"head_dim must be a multiple of {LANES}, got {head_dim}")
        if storage.keys.dtype != self.kv_dtype or storage.values.dtype != self.kv_dtype:
            raise ValueError(f"this kernel reads a {self.kv_dtype} cache, not {storage.keys.dtype}")
        queries = queries.contiguous()
        if out is None:
            out = torch.empty(rows, n_heads * head_dim, dtype=torch.float32)
        status = self._fn(
            _ptr(queries, _F32), _ptr(out, _F32), rows, n_heads, n_kv_heads, head_dim, head_dim ** -0.5,
            storage.keys.data_ptr(), storage.values.data_ptr(), storage.head_stride, storage.slot_stride,
            layout.starts.numel(), _ptr(layout.starts, _I64), _ptr(layout.steps, _I64), _ptr(layout.first_rows, _I64),
            _ptr(layout.slot_offsets, _I64), _ptr(layout.slots, _I64), _ptr(layout.ancestor_offsets, _I64),
            _ptr(layout.ancestor_columns, _I64), torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("tree_attention: out of memory for its scratch buffers")
        return out


def _ptr(tensor: torch.Tensor, kind):
    return ctypes.cast(tensor.data_ptr(), kind)


def load(cache_dir: Path | None = None, kv_dtype: torch.dtype = torch.float32) -> NativeAttention | None:
    """The kernel for a cache of `kv_dtype` (one of KV_DTYPES), None without a C compiler."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"the CPU attention kernel reads a cache of {list(KV_DTYPES)}, not {kv_dtype}")
    library = native_build.build((SOURCE,), FLAGS + KV_DTYPES[kv_dtype], cache_dir)
    return NativeAttention(library, kv_dtype) if library is not None else None
