"""The device engine's Triton kernels for every per-row op of a W8A8 decoder step, batch invariant
(tree attention is triton_attention.py).

Greedy tree verification is lossless only if a row's logits do not depend on what else shares
its forward: other tree nodes, other sessions, padding rows, where a prompt chunk ends. On the
device every op that reduces over a row is therefore a kernel of its own whose reduction order
is fixed by the row alone:

  * one program per row (or per row and head); its block sizes are compile-time constants, so
    the order of a `tl.sum` over a row never depends on how many rows the launch has;
  * attention splits a row's visible keys (the committed prefix, then its ancestors) only by the
    row's own sequence: chunks of a fixed size from the first key, blocks of BLOCK_N within a
    chunk, the chunks merged in order -- whatever the other rows or sessions are doing. A tree node
    sees the very sequence that plain decoding of its path sees, so it gets the same chunks, the
    same blocks and the same bits;
  * the matrix products between these kernels are int8 x int8 -> int32 (`torch._int_mm`), which
    is exact whatever blocking the library picks.

The kernels run compiled on CUDA and, for the tests on hosts without a GPU, under Triton's
interpreter on CPU tensors, so the same code is tested in CI and served on the GPU. Shapes in comments: N rows, D model width, H query
heads, KV key/value heads, HD head_dim, G query heads per kv head, F feed-forward width.

Rounding: activations are quantized as round-half-away-from-zero of x / scale (the CPU engine
uses torch.round, half to even); the two engines' bits differ anyway (fp32 attention blocks,
bf16 keys and values), and each is lossless on its own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Globals a compiled kernel reads must be constexpr.
INT8_MAX = tl.constexpr(127.0)
# The smallest normal fp32: an all-zero row keeps a finite scale (and quantizes to zeros).
FP32_TINY = tl.constexpr(1.1754943508222875e-38)


class Kernel:
    """A Triton kernel launched by its first tensor's device: compiled for the GPU's tensors; for
    CPU tensors Triton must run as its interpreter, which it decides when it is first imported
    (TRITON_INTERPRET=1 in the environment then, as the tests set it on hosts without CUDA)."""

    def __init__(self, fn):
        self.fn = triton.jit(fn)
        functools.update_wrapper(self, fn)

    def launch(self, grid, first: torch.Tensor, *args, **kwargs) -> None:
        if first.device.type == "cpu" and not triton.knobs.runtime.interpret:
            raise RuntimeError(
                "the device engine's kernels run on CPU tensors only under Triton's interpreter: "
                "set TRITON_INTERPRET=1 before triton is first imported"
            )
        self.fn[grid](first, *args, **kwargs)


def kernel(fn) -> Kernel:
    return Kernel(fn)


def block_for(width: int) -> int:
    """The power-of-two tile that covers a row of `width` elements."""
    return triton.next_power_of_2(max(int(width), 16))


# ---- residual add, RMSNorm and per-row int8 quantization ----------------------------------------

@kernel
def _residual_norm_quant(
    h_ptr,          # fp32 [N, D]: the residual stream, updated in place
    acc_ptr,        # int32 [N, D]: the last GEMM's sums (HAS_ACC)
    acc_scale_ptr,  # fp32 [N]: that GEMM's input row scales
    w_scale_ptr,    # fp32 [D]: that GEMM's per-channel weight scales
    emb_ptr,        # fp32, bf16 or fp16 [V, D]: embedding table (FROM_EMBEDDING)
    tok_ptr,        # int32 [N]: token ids (FROM_EMBEDDING)
    norm_ptr,       # fp32 [D]: RMSNorm weight
    q_ptr,          # int8 [N, D]: out, the normed row quantized
    q_scale_ptr,    # fp32 [N]: out, its scale
    D, eps,
    HAS_ACC: tl.constexpr, FROM_EMBEDDING: tl.constexpr, WRITE_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    if FROM_EMBEDDING:
        token = tl.load(tok_ptr + row).to(tl.int64)
        h = tl.load(emb_ptr + token * D + cols, mask=inside, other=0.0).to(tl.float32)
    else:
        h = tl.load(h_ptr + row * D + cols, mask=inside, other=0.0)
    if HAS_ACC:
        acc = tl.load(acc_ptr + row * D + cols, mask=inside, other=0).to(tl.float32)
        x_scale = tl.load(acc_scale_ptr + row)
        w_scale = tl.load(w_scale_ptr + cols, mask=inside, other=0.0)
        h = h + acc * x_scale * w_scale
    if WRITE_H:
        tl.store(h_ptr + row * D + cols, h, mask=inside)
    mean_square = tl.sum(h * h, axis=0) / D
    y = h / tl.sqrt(mean_square + eps) * tl.load(norm_ptr + cols, mask=inside, other=0.0)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / INT8_MAX, FP32_TINY)
    v = y / scale
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(q_ptr + row * D + cols, q.to(tl.int8), mask=inside)
    tl.store(q_scale_ptr + row, scale)


def residual_norm_quant(h, norm_weight, eps, q, q_scale, acc=None, acc_scale=None, w_scale=None,
                        embedding=None, tokens=None) -> None:
    """h [N, D] fp32 (+)= acc * acc_scale * w_scale (or := embedding[tokens]); then q, q_scale :=
    int8 quantization of RMSNorm(h) * norm_weight, per row."""
    rows, width = h.shape
    has_acc, from_embedding = acc is not None, embedding is not None
    _residual_norm_quant.launch(
        (rows,), h, acc if has_acc else h, acc_scale if has_acc else h, w_scale if has_acc else h,
        embedding if from_embedding else h, tokens if from_embedding else h, norm_weight, q, q_scale,
        width, eps, HAS_ACC=has_acc, FROM_EMBEDDING=from_embedding, WRITE_H=has_acc or from_embedding,
        BLOCK_D=block_for(width),
    )


# ---- per-row int8 quantization of a float row ----------------------------------------------------

@kernel
def _quant_rows(
    x_ptr,        # fp32 [N, K]
    q_ptr,        # int8 [N, K]: out
    q_scale_ptr,  # fp32 [N]: out
    K, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    largest = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):  # max is exact in any order; the loop keeps any K in registers
        x = tl.load(x_ptr + row * K + start + cols, mask=start + cols < K, other=0.0)
        largest = tl.maximum(largest, tl.abs(x))
    scale = tl.maximum(tl.max(largest, axis=0) / INT8_MAX, FP32_TINY)
    for start in range(0, K, BLOCK):
        inside = start + cols < K
        v = tl.load(x_ptr + row * K + start + cols, mask=inside, other=0.0) / scale
        q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
        tl.store(q_ptr + row * K + start + cols, q.to(tl.int8), mask=inside)
    tl.store(q_scale_ptr + row, scale)


def quant_rows(x, q, q_scale) -> None:
    rows, width = x.shape
    _quant_rows.launch((rows,), x, q, q_scale, width, BLOCK=min(block_for(width), 4096))


# ---- q/k/v: dequantize, bias, per-head q/k norms, rotary, keys and values into the paged cache ---

@kernel
def _qkv_rotary_store(
    acc_ptr,        # int32 [N, (H + 2 KV) HD]: the fused q/k/v GEMM's sums
    x_scale_ptr,    # fp32 [N]
    w_scale_ptr,    # fp32 [(H + 2 KV) HD]
    bias_ptr,       # fp32 [(H + 2 KV) HD] (HAS_BIAS)
    q_norm_ptr,     # fp32 [HD]: RMSNorm weight of every query head (HAS_QK_NORM: Qwen3)
    k_norm_ptr,     # fp32 [HD]: RMSNorm weight of every key head (HAS_QK_NORM)
    pos_ptr,        # int32 [N]: each row's position
    cos_ptr,        # fp32 [max_position, HD]
    sin_ptr,        # fp32 [max_position, HD]: sin with rotate_half's sign folded in
    slot_ptr,       # int32 [N]: each row's slot in the cache
    q_ptr,          # fp32 [N, H HD]: out, rotated queries
    k_ptr,          # bf16/fp16 [KV, slots, HD]: this layer's keys
    v_ptr,          # bf16/fp16 [KV, slots, HD]: this layer's values
    H, KV, slots, eps,
    HD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1: query heads; H..H+KV-1: kv heads (key and value)
    width = (H + 2 * KV) * HD
    d = tl.arange(0, HD)
    partner = (d + HD // 2) % HD  # rotate_half reads the other half
    x_scale = tl.load(x_scale_ptr + row)
    position = tl.load(pos_ptr + row).to(tl.int64)
    cos = tl.load(cos_ptr + position * HD + d)
    sin = tl.load(sin_ptr + position * HD + d)
    col = head * HD  # q heads, then k heads: the same offsets in the fused output
    x = tl.load(acc_ptr + row * width + col + d).to(tl.float32) * x_scale * tl.load(w_scale_ptr + col + d)
    xp = tl.load(acc_ptr + row * width + col + partner).to(tl.float32) * x_scale * tl.load(w_scale_ptr + col + partner)
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + col + d)
        xp = xp + tl.load(bias_ptr + col + partner)
    if HAS_QK_NORM:
        # The head's own RMSNorm: x holds the whole head (xp the same values, permuted), so one
        # sum over this program's HD elements, in an order fixed by the head alone.
        inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
        norm_ptr = q_norm_ptr if head < H else k_norm_ptr
        x = x * inverse * tl.load(norm_ptr + d)
        xp = xp * inverse * tl.load(norm_ptr + partner)
    rotated = x * cos + xp * sin
    if head < H:
        tl.store(q_ptr + row * H * HD + col + d, rotated)
    else:
        kv_head = (head - H).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        tl.store(k_ptr + (kv_head * slots + slot) * HD + d, rotated.to(k_ptr.dtype.element_ty))
        vcol = (H + KV) * HD + kv_head * HD
        value = tl.load(acc_ptr + row * width + vcol + d).to(tl.float32) * x_scale * tl.load(w_scale_ptr + vcol + d)
        if HAS_BIAS:
            value = value + tl.load(bias_ptr + vcol + d)
        tl.store(v_ptr + (kv_head * slots + slot) * HD + d, value.to(v_ptr.dtype.element_ty))


def qkv_rotary_store(acc, x_scale, w_scale, bias, positions, cos, sin, slots, q, keys, values,
                     n_heads: int, n_kv_heads: int, q_norm=None, k_norm=None, eps: float = 0.0) -> None:
    """Dequantizes the fused q/k/v sums (+ bias), normalizes each q and k head by q_norm / k_norm
    [HD] when given (Qwen3), rotates q and k, writes q [N, H HD] and stores each row's key and
    value at its slot of keys/values [KV, slots, HD]."""
    rows = acc.shape[0]
    head_dim = cos.shape[1]
    has_qk_norm = q_norm is not None
    _qkv_rotary_store.launch(
        (rows, n_heads + n_kv_heads), acc, x_scale, w_scale, bias if bias is not None else w_scale,
        q_norm if has_qk_norm else w_scale, k_norm if has_qk_norm else w_scale,
        positions, cos, sin, slots, q, keys, values, n_heads, n_kv_heads, keys.shape[1], eps,
        HD=head_dim, HAS_BIAS=bias is not None, HAS_QK_NORM=has_qk_norm,
    )


# ---- SwiGLU, with down_proj's online Hadamard rotation -------------------------------------------

@kernel
def _swiglu(
    acc_ptr,      # int32 [N, 2F]: gate then up sums
    x_scale_ptr,  # fp32 [N]
    w_scale_ptr,  # fp32 [2F]
    out_ptr,      # fp32 [N, F]: silu(gate) * up, each HADAMARD block rotated
    F, CHUNK: tl.constexpr, HADAMARD: tl.constexpr,
):
    # One program per (row, CHUNK columns): a chunk holds whole Hadamard blocks.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    inside = cols < F
    x_scale = tl.load(x_scale_ptr + row)
    gate = tl.load(acc_ptr + row * 2 * F + cols, mask=inside, other=0).to(tl.float32) * x_scale \
        * tl.load(w_scale_ptr + cols, mask=inside, other=0.0)
    up = tl.load(acc_ptr + row * 2 * F + F + cols, mask=inside, other=0).to(tl.float32) * x_scale \
        * tl.load(w_scale_ptr + F + cols, mask=inside, other=0.0)
    y = gate / (1.0 + tl.exp(-gate)) * up
    if HADAMARD > 0:
        # y @ H, H[i, j] = (-1) ** popcount(i & j): Sylvester's unnormalized Hadamard matrix,
        # the same linear map as quant.block_hadamard's butterflies.
        i = tl.arange(0, HADAMARD)[:, None]
        j = tl.arange(0, HADAMARD)[None, :]
        bits = i & j
        bits = bits ^ (bits >> 8)
        bits = bits ^ (bits >> 4)
        bits = bits ^ (bits >> 2)
        bits = bits ^ (bits >> 1)
        sign = 1.0 - 2.0 * (bits & 1).to(tl.float32)
        blocks = tl.reshape(y, [CHUNK // HADAMARD, HADAMARD])
        y = tl.reshape(tl.sum(blocks[:, :, None] * sign[None, :, :], axis=1), [CHUNK])
    tl.store(out_ptr + row * F + cols, y, mask=inside)


def swiglu(acc, x_scale, w_scale, out, hadamard: int) -> None:
    rows, width = out.shape
    chunk = hadamard if hadamard else min(block_for(width), 1024)
    _swiglu.launch((rows, triton.cdiv(width, chunk)), acc, x_scale, w_scale, out, width,
                   CHUNK=chunk, HADAMARD=hadamard)


# ---- the LM head's dequantization ----------------------------------------------------------------

@kernel
def _dequant(
    acc_ptr,      # int32 [N, M]
    x_scale_ptr,  # fp32 [N]
    w_scale_ptr,  # fp32 [M]
    out_ptr,      # fp32 [N, M]
    M, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < M
    acc = tl.load(acc_ptr + row * M + cols, mask=inside, other=0).to(tl.float32)
    out = acc * tl.load(x_scale_ptr + row) * tl.load(w_scale_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * M + cols, out, mask=inside)


def dequant(acc, x_scale, w_scale, out) -> None:
    rows, width = out.shape
    _dequant.launch((rows, triton.cdiv(width, 1024)), acc, x_scale, w_scale, out, width, BLOCK=1024)
