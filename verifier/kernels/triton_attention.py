"""The device engine's tree attention (Triton): each row attends to its session's committed
prefix, then to its own ancestors in the step, over the paged KV pool.

Batch invariance (see triton_layers.py for the rest of a step): a row splits its visible keys
only by its own sequence -- chunks of a fixed size from the first key, blocks of BLOCK_N within a
chunk, the chunks merged in order -- whatever the other rows or sessions are doing. A tree node
sees the very sequence that plain decoding of its path sees, so it gets the same chunks, the same
blocks and the same bits. Shapes in comments as in triton_layers.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pardec.verifier.kernels.triton_layers import kernel

@kernel
def _tree_attention_chunk(
    q_ptr,            # fp32 [N, H HD]
    k_ptr,            # bf16/fp16/fp32 [KV, slots, HD]
    v_ptr,            # bf16/fp16/fp32 [KV, slots, HD]
    part_ptr,         # fp32 [N, KV, CHUNKS, G, HD + 2]: out, each chunk's sums, then its max and weight
    start_ptr,        # int32 [N]: committed positions of the row's session
    depth_ptr,        # int32 [N]: the row's depth in its step's tree (a prompt chunk's row: its index)
    table_row_ptr,    # int32 [N]: the row's session: its row of the block table
    anc_ptr,          # int32 [*]: tree rows' ancestors, as step indices, ascending, the row itself last
    anc_at_ptr,       # int32 [N]: where the row's ancestors start in anc_ptr; -1: a chain (rows 0..depth)
    table_ptr,        # int32 [sessions, table_width]: block ids by position // BLOCK_TOKENS
    slots, table_width, H, CHUNKS, sm_scale,
    HD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    # One program per (row, kv head, CHUNK of the row's visible keys): the G query heads sharing
    # that kv head read each key once. A row's visible keys are walked as a compact sequence: the
    # committed positions 0..start-1, then its ancestors in the step, in order. A tree node and the
    # same token decoded plainly (its ancestors committed by then) see the same keys in the same
    # sequence, so cutting it into CHUNKs and blocks from 0 gives both the same partial sums and
    # the same bits; no key is masked but the tail of the last block, the same for both.
    # DOT: the products as tl.dot (G_PAD >= 16 then) instead of a broadcast and tl.sum; either way
    # a program reads only its own row, so whatever instruction the dot becomes, it is invariant.
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
            if DOT:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)  # [G_PAD, BLOCK_N]
            else:
                scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + (plane + slot[:, None]) * HD + d[None, :], mask=valid[:, None], other=0.0)
            if DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        part = part_ptr + ((row * tl.num_programs(1) + kv_head) * CHUNKS + chunk) * G * (HD + 2)
        real = g < G  # the padding heads are not stored
        tl.store(part + g[:, None] * (HD + 2) + d[None, :], acc, mask=real[:, None])
        tl.store(part + g * (HD + 2) + HD, m, mask=real)
        tl.store(part + g * (HD + 2) + HD + 1, total, mask=real)


@kernel
def _tree_attention_combine(
    part_ptr,         # fp32 [N, KV, CHUNKS, G, HD + 2]: the chunks' sums, max and weight
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
    real = g < G
    parts = part_ptr + (row * tl.num_programs(1) + kv_head) * CHUNKS * G * (HD + 2)
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for c in range(0, chunks):  # the max is exact in any order
        m = tl.maximum(m, tl.load(parts + c * G * (HD + 2) + g * (HD + 2) + HD, mask=real, other=0.0))
    total = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HD], dtype=tl.float32)
    for c in range(0, chunks):
        part = parts + c * G * (HD + 2)
        weight = tl.exp(tl.load(part + g * (HD + 2) + HD, mask=real, other=0.0) - m)
        total = total + tl.load(part + g * (HD + 2) + HD + 1, mask=real, other=1.0) * weight
        acc = acc + tl.load(part + g[:, None] * (HD + 2) + d[None, :], mask=real[:, None], other=0.0) * weight[:, None]
    heads = kv_head * G + g
    tl.store(out_ptr + row * H * HD + heads[:, None] * HD + d[None, :], acc / total[:, None], mask=(g < G)[:, None])


# Attention's chunk of keys per program, its block of keys (as fp32 values a program holds, or
# BLOCK_N itself when block_n is set), warps per program, and how the products are made: "sum"
# (a broadcast and tl.sum, CUDA cores) or a tl.dot input precision ("ieee": fp32 FMAs; "tf32x3":
# tensor cores, each fp32 operand split into a high and a low tf32 part, three products summed in
# fp32; bf16 keys and values are exact in tf32, so only q and the softmax weights are split, and
# they keep about 21 of fp32's 24 mantissa bits). Any setting is batch invariant (it is fixed for
# every launch); changing it changes the engine's bits, so it is a constant of the engine, not a
# per-step choice. The default is the fastest that `python -m pardec.bench.device --choose-attention`
# found on an H100 (docs/device-h100.md), which times the alternatives side by side.
ATTENTION_TUNING = {"chunk": 64, "budget": 8192, "block_n": 32, "num_warps": 4, "products": "tf32x3"}


PRODUCTS = ("sum", "ieee", "tf32x3")


def parse_attention_tuning(text: str) -> dict:
    """"chunk=128,products=ieee,block_n=64" -> the ATTENTION_TUNING entries it sets, checked."""
    tuning = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ATTENTION_TUNING:
            raise ValueError(f"attention tuning: unknown key {key!r}; known: {sorted(ATTENTION_TUNING)}")
        if key == "products":
            if value not in PRODUCTS:
                raise ValueError(f"attention tuning: products must be one of {PRODUCTS}, got {value!r}")
            tuning[key] = value
            continue
        number = None if key == "block_n" and value in ("", "none", "None") else int(value)
        if number is not None and (number < 1 or number & (number - 1)):
            raise ValueError(f"attention tuning: {key} must be a power of two, got {value!r}")
        tuning[key] = number
    return tuning


def attention_group_pad(group: int) -> int:
    """Query heads per kv head as a program holds them: a power of two, at least 16 for tl.dot."""
    pad = triton.next_power_of_2(group)
    return pad if ATTENTION_TUNING["products"] == "sum" else max(16, pad)


def attention_block_n(group: int, head_dim: int) -> int:
    """Keys per block: the [G, BLOCK_N, HD] products stay within the budget of fp32 values a program."""
    if ATTENTION_TUNING["block_n"]:
        return ATTENTION_TUNING["block_n"]
    return max(16, min(128, ATTENTION_TUNING["budget"] // (triton.next_power_of_2(group) * head_dim)))


def attention_chunks(max_keys: int) -> int:
    """Chunks a row of at most `max_keys` visible keys is cut into (the launch's third grid axis)."""
    return triton.cdiv(max_keys, ATTENTION_TUNING["chunk"])


def attention_scratch(rows: int, n_kv_heads: int, n_heads: int, head_dim: int, max_keys: int, device) -> torch.Tensor:
    """The chunk partials tree_attention writes, for up to `rows` rows."""
    return torch.empty(rows * n_kv_heads * attention_chunks(max_keys) * (n_heads // n_kv_heads) * (head_dim + 2),
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
    group_pad = attention_group_pad(group)
    if scratch is None:
        scratch = attention_scratch(rows, n_kv_heads, n_heads, head_dim, max_keys, q.device)
    if scratch.numel() < rows * n_kv_heads * chunks * group * (head_dim + 2):
        raise ValueError(f"attention scratch of {scratch.numel()} values is too small for {rows} rows of "
                         f"{chunks} chunks")
    chunk, products = ATTENTION_TUNING["chunk"], ATTENTION_TUNING["products"]
    _tree_attention_chunk.launch(
        (rows, n_kv_heads, chunks), q, keys, values, scratch, starts, depths, table_rows, ancestors, ancestors_at,
        table, slots, table.shape[1], n_heads, chunks, head_dim ** -0.5,
        HD=head_dim, G=group, G_PAD=group_pad, BLOCK_N=attention_block_n(group, head_dim), CHUNK=chunk,
        BLOCK_TOKENS=block_tokens, DOT=products != "sum", PRECISION="ieee" if products == "sum" else products,
        num_warps=ATTENTION_TUNING["num_warps"],
    )
    _tree_attention_combine.launch(
        (rows, n_kv_heads), scratch, out, starts, depths, n_heads, chunks,
        HD=head_dim, G=group, G_PAD=triton.next_power_of_2(group), CHUNK=chunk,  # no tl.dot here
    )
