"""The device engine's Triton kernels: every per-row op of a W8A8 decoder step, batch invariant.

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
    emb_ptr,        # fp32 [V, D]: embedding table (FROM_EMBEDDING)
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
        h = tl.load(emb_ptr + token * D + cols, mask=inside, other=0.0)
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


# ---- q/k/v: dequantize, bias, rotary, keys and values into the paged cache ----------------------

@kernel
def _qkv_rotary_store(
    acc_ptr,        # int32 [N, (H + 2 KV) HD]: the fused q/k/v GEMM's sums
    x_scale_ptr,    # fp32 [N]
    w_scale_ptr,    # fp32 [(H + 2 KV) HD]
    bias_ptr,       # fp32 [(H + 2 KV) HD] (HAS_BIAS)
    pos_ptr,        # int32 [N]: each row's position
    cos_ptr,        # fp32 [max_position, HD]
    sin_ptr,        # fp32 [max_position, HD]: sin with rotate_half's sign folded in
    slot_ptr,       # int32 [N]: each row's slot in the cache
    q_ptr,          # fp32 [N, H HD]: out, rotated queries
    k_ptr,          # bf16/fp16 [KV, slots, HD]: this layer's keys
    v_ptr,          # bf16/fp16 [KV, slots, HD]: this layer's values
    H, KV, slots,
    HD: tl.constexpr, HAS_BIAS: tl.constexpr,
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
                     n_heads: int, n_kv_heads: int) -> None:
    """Dequantizes the fused q/k/v sums, rotates q and k, writes q [N, H HD] and stores each row's
    key and value at its slot of keys/values [KV, slots, HD]."""
    rows = acc.shape[0]
    head_dim = cos.shape[1]
    _qkv_rotary_store.launch(
        (rows, n_heads + n_kv_heads), acc, x_scale, w_scale, bias if bias is not None else w_scale,
        positions, cos, sin, slots, q, keys, values, n_heads, n_kv_heads, keys.shape[1],
        HD=head_dim, HAS_BIAS=bias is not None,
    )


# ---- tree attention over the paged cache ---------------------------------------------------------

@kernel
def _tree_attention_chunk(
    q_ptr,            # fp32 [N, H HD]
    k_ptr,            # bf16/fp16/fp32 [KV, slots, HD]
    v_ptr,            # bf16/fp16/fp32 [KV, slots, HD]
    part_ptr,         # fp32 [N, KV, CHUNKS, G_PAD, HD + 2]: out, each chunk's sums, then its max and weight
    start_ptr,        # int32 [N]: committed positions of the row's session
    depth_ptr,        # int32 [N]: the row's depth in its step's tree (a prompt chunk's row: its index)
    table_row_ptr,    # int32 [N]: the row's session: its row of the block table
    anc_ptr,          # int32 [*]: tree rows' ancestors, as step indices, ascending, the row itself last
    anc_at_ptr,       # int32 [N]: where the row's ancestors start in anc_ptr; -1: a chain (rows 0..depth)
    table_ptr,        # int32 [sessions, table_width]: block ids by position // BLOCK_TOKENS
    slots, table_width, H, CHUNKS, sm_scale,
    HD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
):
    # One program per (row, kv head, CHUNK of the row's visible keys): the G query heads sharing
    # that kv head read each key once. A row's visible keys are walked as a compact sequence: the
    # committed positions 0..start-1, then its ancestors in the step, in order. A tree node and the
    # same token decoded plainly (its ancestors committed by then) see the same keys in the same
    # sequence, so cutting it into CHUNKs and blocks from 0 gives both the same partial sums and
    # the same bits; no key is masked but the tail of the last block, the same for both.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    start = tl.load(start_ptr + row)
    visible = start + tl.load(depth_ptr + row) + 1
    first_rank = chunk * CHUNK
    if first_rank < visible:
        end = tl.minimum(first_rank + CHUNK, visible)
        table = table_ptr + tl.load(table_row_ptr + row).to(tl.int64) * table_width
        anc_at = tl.load(anc_at_ptr + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        heads = kv_head * G + g
        q = tl.load(q_ptr + row * H * HD + heads[:, None] * HD + d[None, :], mask=(g < G)[:, None], other=0.0)
        q = q * sm_scale
        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        total = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HD], dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        plane = kv_head * slots
        for first in range(first_rank, end, BLOCK_N):
            rank = first + n
            valid = rank < end
            if anc_at >= 0:
                ancestor = tl.load(anc_ptr + anc_at + (rank - start), mask=valid & (rank >= start), other=0)
                pos = tl.where(rank < start, rank, start + ancestor)
            else:
                pos = rank
            block = tl.load(table + pos // BLOCK_TOKENS, mask=valid, other=0).to(tl.int64)
            slot = block * BLOCK_TOKENS + pos % BLOCK_TOKENS
            k = tl.load(k_ptr + (plane + slot[:, None]) * HD + d[None, :], mask=valid[:, None], other=0.0)
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + (plane + slot[:, None]) * HD + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        part = part_ptr + ((row * tl.num_programs(1) + kv_head) * CHUNKS + chunk) * G_PAD * (HD + 2)
        tl.store(part + g[:, None] * (HD + 2) + d[None, :], acc)
        tl.store(part + g * (HD + 2) + HD, m)
        tl.store(part + g * (HD + 2) + HD + 1, total)


@kernel
def _tree_attention_combine(
    part_ptr,         # fp32 [N, KV, CHUNKS, G_PAD, HD + 2]: the chunks' sums, max and weight
    out_ptr,          # fp32 [N, H HD]: out
    start_ptr, depth_ptr,
    H, CHUNKS,
    HD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    # One program per (row, kv head): the row's chunks merged in order, by the same arithmetic
    # whatever else the launch holds.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    visible = tl.load(start_ptr + row) + tl.load(depth_ptr + row) + 1
    chunks = (visible + CHUNK - 1) // CHUNK
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HD)
    parts = part_ptr + (row * tl.num_programs(1) + kv_head) * CHUNKS * G_PAD * (HD + 2)
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for c in range(0, chunks):  # the max is exact in any order
        m = tl.maximum(m, tl.load(parts + c * G_PAD * (HD + 2) + g * (HD + 2) + HD))
    total = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HD], dtype=tl.float32)
    for c in range(0, chunks):
        part = parts + c * G_PAD * (HD + 2)
        weight = tl.exp(tl.load(part + g * (HD + 2) + HD) - m)
        total = total + tl.load(part + g * (HD + 2) + HD + 1) * weight
        acc = acc + tl.load(part + g[:, None] * (HD + 2) + d[None, :]) * weight[:, None]
    heads = kv_head * G + g
    tl.store(out_ptr + row * H * HD + heads[:, None] * HD + d[None, :], acc / total[:, None], mask=(g < G)[:, None])


def attention_block_n(group: int, head_dim: int, budget: int = 8192) -> int:
    """Keys per block: the [G, BLOCK_N, HD] products stay within `budget` fp32 values a program."""
    return max(16, min(128, budget // (triton.next_power_of_2(group) * head_dim)))


# Attention's chunk of keys per program, its block of keys (as fp32 values a program holds) and
# warps per program. Any setting is batch invariant (it is fixed for every launch); changing it
# changes the engine's bits, so it is a constant of the engine, not a per-step choice.
# bench.device times alternatives.
ATTENTION_TUNING = {"chunk": 128, "budget": 8192, "num_warps": 4}


def attention_chunks(max_keys: int) -> int:
    """Chunks a row of at most `max_keys` visible keys is cut into (the launch's third grid axis)."""
    return triton.cdiv(max_keys, ATTENTION_TUNING["chunk"])


def attention_scratch(rows: int, n_kv_heads: int, n_heads: int, head_dim: int, max_keys: int, device) -> torch.Tensor:
    """The chunk partials tree_attention writes, for up to `rows` rows."""
    group_pad = triton.next_power_of_2(n_heads // n_kv_heads)
    return torch.empty(rows * n_kv_heads * attention_chunks(max_keys) * group_pad * (head_dim + 2),
                       dtype=torch.float32, device=device)


def tree_attention(q, keys, values, out, starts, depths, table_rows, ancestors, ancestors_at, table,
                   n_heads: int, block_tokens: int, scratch: torch.Tensor | None = None,
                   max_keys: int | None = None) -> None:
    """out [N, H HD] := each row's attention over its session's committed keys and its ancestors
    in the step (all of them already stored in keys/values [KV, slots, HD]). Each row's keys are
    cut into chunks of ATTENTION_TUNING["chunk"] (one program each, all in parallel), then merged
    in order. scratch: from attention_scratch for at least these rows and `max_keys` (allocated
    here when None); max_keys: the most keys a row sees (default: what the block table addresses)."""
    rows = q.shape[0]
    n_kv_heads, slots, head_dim = keys.shape
    group = n_heads // n_kv_heads
    max_keys = max_keys or table.shape[1] * block_tokens
    chunks = attention_chunks(max_keys)
    group_pad = triton.next_power_of_2(group)
    if scratch is None:
        scratch = attention_scratch(rows, n_kv_heads, n_heads, head_dim, max_keys, q.device)
    if scratch.numel() < rows * n_kv_heads * chunks * group_pad * (head_dim + 2):
        raise ValueError(f"attention scratch of {scratch.numel()} values is too small for {rows} rows of "
                         f"{chunks} chunks")
    chunk = ATTENTION_TUNING["chunk"]
    _tree_attention_chunk.launch(
        (rows, n_kv_heads, chunks), q, keys, values, scratch, starts, depths, table_rows, ancestors, ancestors_at,
        table, slots, table.shape[1], n_heads, chunks, head_dim ** -0.5,
        HD=head_dim, G=group, G_PAD=group_pad, BLOCK_N=attention_block_n(group, head_dim, ATTENTION_TUNING["budget"]),
        CHUNK=chunk, BLOCK_TOKENS=block_tokens, num_warps=ATTENTION_TUNING["num_warps"],
    )
    _tree_attention_combine.launch(
        (rows, n_kv_heads), scratch, out, starts, depths, n_heads, chunks,
        HD=head_dim, G=group, G_PAD=group_pad, CHUNK=chunk,
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
        # the same linear map as rotation.block_hadamard's butterflies.
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
