"""The device engine: a W8A8 decoder step as a short chain of kernels, replayed as a CUDA graph.

On a GPU a small model's step is bound by how many kernels it launches, not by arithmetic: the
module-by-module forward of transformer.py launches thousands per step. Here a decoder layer is ten
launches, four int8 GEMMs (exact int32 sums: torch._int_mm or triton_int8_gemm.py's kernel, whichever
is faster for the shape) and six Triton kernels (triton_layers.py, triton_attention.py) that fuse
everything between them:

    norm+quant -> GEMM qkv -> dequant (+q/k head norms)+rotary+store k,v -> tree attention -> quant -> GEMM o
    -> residual+norm+quant -> GEMM gate/up -> SwiGLU (+ online Hadamard) -> quant -> GEMM down
    (whose residual add is the next layer's first kernel)

and the whole step is captured once per bucket of rows (32, 64, ..., 512; padding rows are
a session of their own, in the pool's scratch block) and replayed: one graph launch, one copy
of the step's metadata in, the logits out. Everything a step varies -- which sessions, how many
rows each, their positions, tree masks, cache blocks -- is data in static buffers, so one graph
per bucket serves every mix of sessions and tree shapes.

Lossless as the CPU engine is: every kernel's per-row result is independent of the rest of the
launch (triton_layers.py, triton_attention.py), so a row's logits are bit-identical alone, in a tree, beside other
sessions, padded into any bucket, or in a prompt chunk. Its bits differ from the CPU engine's
(bf16 keys and values, fp32 attention in other blocks), as any two engines' do.

On CPU tensors the same kernels run under Triton's interpreter, eagerly: what the tests without a
GPU check (slowly, on small models).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pardec.verifier.kernels import triton_attention, triton_int8_gemm, triton_layers
from pardec.verifier.model.kvcache import KVPool, PagedCache
from pardec.verifier.model.step import StepInput

# Rows of the captured steps. torch._int_mm on CUDA needs more than 16 rows and a multiple of 8.
GRAPH_BUCKETS = (32, 64, 128, 256, 512)
CUDA_MIN_ROWS = 24
KV_DTYPE = torch.bfloat16


def padded_rows(rows: int, bucketed: bool) -> int:
    """Rows a step of `rows` runs as: bucketed (on CUDA), its graph bucket, or a multiple of 8
    (at least 24) beyond the largest bucket; else the rows themselves.

    >>> padded_rows(1, True), padded_rows(33, True), padded_rows(600, True), padded_rows(5, False)
    (32, 64, 600, 5)
    """
    if not bucketed:
        return rows
    for bucket in GRAPH_BUCKETS:
        if rows <= bucket:
            return bucket
    return max(CUDA_MIN_ROWS, -(-rows // 8) * 8)


@dataclass
class _Layer:
    attention_norm: torch.Tensor
    wqkv: torch.Tensor  # int8 [D, (H + 2 KV) HD], a column-major view (what _int_mm reads)
    wqkv_scale: torch.Tensor
    wqkv_bias: torch.Tensor | None
    wo: torch.Tensor
    wo_scale: torch.Tensor
    ffn_norm: torch.Tensor
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    hadamard: int
    q_norm: torch.Tensor | None = None  # [HD], each query head's RMSNorm weight (Qwen3)
    k_norm: torch.Tensor | None = None


class _Buffers:
    """Every tensor a step reads or writes, allocated once for `rows`: graphs capture addresses."""

    FIELDS = ("tokens", "positions", "slots", "starts", "depths", "table_rows", "ancestors_at", "out_rows")

    def __init__(self, model, rows: int, table_width: int, device: torch.device, max_keys: int):
        args = model.args
        q_width = args.n_heads * args.head_dim
        qkv_width = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.rows, self.table_width, self.max_keys = rows, table_width, max_keys
        self.attention_tuning = dict(triton_attention.ATTENTION_TUNING)  # the scratch's size depends on it
        self.table_at = len(self.FIELDS) * rows
        # Per-row metadata, then the block table (one row per session, the padding's last).
        self.meta_size = self.table_at + (rows + 1) * table_width
        pinned = device.type == "cuda"
        self.host_meta = torch.zeros(self.meta_size, dtype=torch.int32, pin_memory=pinned)
        # Tree rows' ancestor lists: at most rows * (rows + 1) / 2 entries.
        self.host_ancestors = torch.zeros(rows * (rows + 1) // 2, dtype=torch.int32, pin_memory=pinned)
        self.meta = torch.zeros(self.meta_size, dtype=torch.int32, device=device)
        self.ancestors = torch.zeros(rows * (rows + 1) // 2, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if pinned else None
        f32, i8, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int8, device=device), \
            dict(dtype=torch.int32, device=device)
        self.h = torch.zeros(rows, args.dim, **f32)
        self.x_norm, self.s_norm = torch.zeros(rows, args.dim, **i8), torch.zeros(rows, **f32)
        self.acc_qkv = torch.zeros(rows, qkv_width, **i32)
        self.q = torch.zeros(rows, q_width, **f32)
        self.attn = torch.zeros(rows, q_width, **f32)
        self.x_attn, self.s_attn = torch.zeros(rows, q_width, **i8), torch.zeros(rows, **f32)
        self.acc_model = torch.zeros(rows, args.dim, **i32)
        self.acc_ffn = torch.zeros(rows, 2 * args.ffn_dim, **i32)
        self.ffn = torch.zeros(rows, args.ffn_dim, **f32)
        self.x_ffn, self.s_ffn = torch.zeros(rows, args.ffn_dim, **i8), torch.zeros(rows, **f32)
        self.x_head, self.s_head = torch.zeros(rows, args.dim, **i8), torch.zeros(rows, **f32)
        self.acc_head = torch.zeros(rows, args.vocab_size, **i32)
        self.logits = torch.zeros(rows, args.vocab_size, **f32)
        # A row sees at most max_keys keys (_buffers_for).
        self.attention_scratch = triton_attention.attention_scratch(rows, args.n_kv_heads, args.n_heads, args.head_dim,
                                                           max_keys, device)

    def field(self, name: str, rows: int) -> torch.Tensor:
        at = self.FIELDS.index(name) * self.rows
        return self.meta[at : at + rows]

    def table(self) -> torch.Tensor:
        return self.meta[self.table_at :].view(self.rows + 1, self.table_width)


class DeviceForward:
    """forward_batch of a W8A8 Transformer whose sessions live in a KVPool of KV_DTYPE."""

    def __init__(self, model, use_graphs: bool = True):
        from pardec.verifier.model.quant import W8A8Linear

        self.model = model
        args = model.args
        self.args = args
        self.use_graphs = use_graphs
        # The int8 products: torch._int_mm or a Triton tiling, chosen per shape (triton_int8_gemm.py).
        self.gemm = triton_int8_gemm.Int8Gemm(triton_int8_gemm.parse_gemm(triton_int8_gemm.GEMM))
        # Pad to the buckets on CPU too: the tests of the padding logic on hosts without a GPU.
        self.bucket_on_cpu = False
        linears = [model.output]
        for block in model.layers:
            linears += [block.attention.wqkv, block.attention.wo, block.feed_forward.w13, block.feed_forward.w2]
        for linear in linears:
            if not isinstance(linear, W8A8Linear) or linear.kernel != "int_mm":
                raise ValueError("the device engine needs every linear layer W8A8 with the int_mm kernel")
            if linear.in_features % 8 or linear.out_features % 8:
                raise ValueError(f"the device engine needs layer widths that are multiples of 8, got "
                                 f"{linear.in_features} x {linear.out_features}")
        if args.head_dim & (args.head_dim - 1):
            raise ValueError(f"the device engine needs a power-of-two head_dim, got {args.head_dim}")
        self._lock = threading.Lock()
        self._layers: list[_Layer] | None = None
        self._buffers: _Buffers | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.graph_replays = self.eager_runs = 0

    # ---- weights, read from the model once it is on its device ---------------------------------

    def _weights(self) -> list[_Layer]:
        if self._layers is None:
            layers = []
            for block in self.model.layers:
                attention, ffn = block.attention, block.feed_forward
                for linear in (attention.wo, ffn.w13, self.model.output):
                    if linear.bias is not None or linear.input_hadamard:
                        raise ValueError("the device engine supports a bias on q/k/v and a Hadamard on down_proj only")
                if attention.wqkv.input_hadamard or ffn.w13.input_hadamard or ffn.w2.bias is not None:
                    raise ValueError("the device engine supports a bias on q/k/v and a Hadamard on down_proj only")
                layers.append(_Layer(
                    block.attention_norm.weight, attention.wqkv.weight_chunks[0], attention.wqkv.weight_scale,
                    attention.wqkv.bias, attention.wo.weight_chunks[0], attention.wo.weight_scale,
                    block.ffn_norm.weight, ffn.w13.weight_chunks[0], ffn.w13.weight_scale,
                    ffn.w2.weight_chunks[0], ffn.w2.weight_scale, ffn.w2.input_hadamard,
                    *(norm.weight if norm is not None else None for norm in (attention.q_norm, attention.k_norm)),
                ))
            self._layers = layers
        return self._layers

    def _buffers_for(self, rows: int, pool: KVPool, device: torch.device) -> _Buffers:
        # A row sees at most the model's positions and at most what the pool holds: a model whose
        # rotary scaling states a long context (YaRN's 131072) sizes nothing beyond its pool.
        max_keys = min(pool.max_position, pool.capacity_tokens)
        table_width = -(-max_keys // pool.block_tokens) + 1
        current = self._buffers
        if (current is None or current.rows < rows or current.table_width < table_width or current.max_keys < max_keys
                or current.attention_tuning != triton_attention.ATTENTION_TUNING):
            rows = max(rows, current.rows if current else 0, GRAPH_BUCKETS[-1] if device.type == "cuda" else 0)
            table_width = max(table_width, current.table_width if current else 0)
            max_keys = max(max_keys, current.max_keys if current else 0)
            self._graphs.clear()  # they captured the old buffers' addresses
            self._buffers = None  # frees the old buffers first
            self._buffers = _Buffers(self.model, rows, table_width, device, max_keys)
        return self._buffers

    # ---- one forward --------------------------------------------------------------------------

    def forward_batch(self, items: list[StepInput]) -> list[torch.Tensor]:
        pool = _common_pool(items)
        device = pool.kv.device
        with self._lock:
            steps = [int(item.tokens.shape[0]) for item in items]
            total = sum(steps)
            bucketed = device.type == "cuda" or self.bucket_on_cpu
            rows = padded_rows(total, bucketed)
            buffers = self._buffers_for(rows, pool, device)
            head_rows, counts = self._pack(buffers, items, steps, rows, pool, bucketed)
            graphed = self.use_graphs and device.type == "cuda" and rows in GRAPH_BUCKETS
            if graphed and (id(pool), rows) in self._graphs:
                self._graphs[id(pool), rows].replay()
                self.graph_replays += 1
            else:
                self._run(buffers, rows, rows if graphed else head_rows, pool)
                self.eager_runs += 1
                if graphed:
                    self._capture(buffers, rows, pool)
            logits = buffers.logits[: sum(counts)].clone()
        return list(logits.split(counts))

    def _pack(self, buffers: _Buffers, items: list[StepInput], steps: list[int], rows: int, pool: KVPool,
              bucketed: bool) -> tuple[int, list[int]]:
        """Fills the host copies of the step's metadata and sends them in two copies. Returns the
        rows the LM head must score (the wanted ones, padded as _int_mm needs) and the count
        wanted per item."""
        meta = buffers.host_meta.numpy()
        ancestor_lists = buffers.host_ancestors.numpy()
        if buffers.copied is not None:
            buffers.copied.synchronize()  # the last step's copy has read the pinned buffers
        n = buffers.rows
        fields = {name: meta[i * n : (i + 1) * n] for i, name in enumerate(_Buffers.FIELDS)}
        table = meta[buffers.table_at :].reshape(n + 1, buffers.table_width)
        bt = pool.block_tokens
        offset = listed = wanted = 0
        counts = []
        for index, (item, count) in enumerate(zip(items, steps)):
            cache = item.cache
            start = cache.length
            cache.begin_step(count)  # raises unless reserved
            depths = _host(item.depths).astype(np.int64)
            ancestors = _host(item.ancestors).astype(bool)
            if depths.shape != (count,) or ancestors.shape != (count, count):
                raise ValueError(f"depths must be [{count}] and ancestors [{count}, {count}]")
            lower = np.tril(np.ones((count, count), dtype=bool))
            if not ancestors.diagonal().all() or (ancestors & ~lower).any():
                raise ValueError("ancestors must be lower-triangular with a True diagonal (parents come first)")
            blocks = np.asarray(cache.blocks, dtype=np.int64)
            if len(blocks) > buffers.table_width:
                raise ValueError(f"a session of {len(blocks)} blocks exceeds the block table's {buffers.table_width}")
            span = slice(offset, offset + count)
            step_positions = start + np.arange(count)
            fields["tokens"][span] = _host(item.tokens)
            fields["positions"][span] = start + depths
            fields["slots"][span] = blocks[step_positions // bt] * bt + step_positions % bt
            fields["starts"][span] = start
            fields["table_rows"][span] = index
            table[index, : len(blocks)] = blocks
            if (ancestors == lower).all():
                fields["depths"][span] = np.arange(count)
                fields["ancestors_at"][span] = -1  # a chain (a prompt chunk): row i sees rows 0..i
            else:
                sizes = ancestors.sum(axis=1)
                fields["depths"][span] = sizes - 1
                fields["ancestors_at"][span] = listed + np.cumsum(sizes) - sizes
                columns = np.nonzero(ancestors)[1]  # row by row, ascending
                ancestor_lists[listed : listed + len(columns)] = columns
                listed += len(columns)
            wanted_rows = np.arange(count) if item.output_rows is None else _host(item.output_rows).astype(np.int64)
            fields["out_rows"][wanted : wanted + len(wanted_rows)] = offset + wanted_rows
            wanted += len(wanted_rows)
            counts.append(len(wanted_rows))
            offset += count
        # Padding rows: a session of one position in the pool's scratch block, its own only key.
        pad = slice(offset, rows)
        fields["tokens"][pad] = 0
        fields["positions"][pad] = 0
        fields["slots"][pad] = pool.scratch_block * bt
        fields["starts"][pad] = 0
        fields["depths"][pad] = 0
        fields["table_rows"][pad] = len(items)
        fields["ancestors_at"][pad] = -1
        table[len(items), 0] = pool.scratch_block
        head_rows = max(CUDA_MIN_ROWS, -(-wanted // 8) * 8) if bucketed else wanted
        fields["out_rows"][wanted:rows] = 0
        used = buffers.table_at + (len(items) + 1) * buffers.table_width
        buffers.meta[:used].copy_(buffers.host_meta[:used], non_blocking=True)
        if listed:
            buffers.ancestors[:listed].copy_(buffers.host_ancestors[:listed], non_blocking=True)
        if buffers.copied is not None:
            buffers.copied.record()
        return head_rows, counts

    def _run(self, b: _Buffers, rows: int, head_rows: int, pool: KVPool) -> None:
        """The step's kernels over the first `rows` rows; the LM head over `head_rows` picked rows."""
        args, model = self.args, self.model
        layers = self._weights()
        H, KV = args.n_heads, args.n_kv_heads
        tokens, positions, slots = b.field("tokens", rows), b.field("positions", rows), b.field("slots", rows)
        starts, depths, table_rows = b.field("starts", rows), b.field("depths", rows), b.field("table_rows", rows)
        ancestors_at, table = b.field("ancestors_at", rows), b.table()
        h, x_norm, s_norm = b.h[:rows], b.x_norm[:rows], b.s_norm[:rows]
        acc_qkv, q, attn = b.acc_qkv[:rows], b.q[:rows], b.attn[:rows]
        x_attn, s_attn, acc_model = b.x_attn[:rows], b.s_attn[:rows], b.acc_model[:rows]
        acc_ffn, ffn, x_ffn, s_ffn = b.acc_ffn[:rows], b.ffn[:rows], b.x_ffn[:rows], b.s_ffn[:rows]
        eps = args.norm_eps
        cos, sin = model.rope_cos, model.rope_signed_sin
        triton_layers.residual_norm_quant(h, layers[0].attention_norm, eps, x_norm, s_norm,
                                    embedding=model.tok_embeddings, tokens=tokens)
        for index, layer in enumerate(layers):
            if index:
                triton_layers.residual_norm_quant(h, layer.attention_norm, eps, x_norm, s_norm,
                                            acc=acc_model, acc_scale=s_ffn, w_scale=layers[index - 1].w2_scale)
            self.gemm(x_norm, layer.wqkv, acc_qkv)
            keys, values = pool.kv[index, 0], pool.kv[index, 1]
            triton_layers.qkv_rotary_store(acc_qkv, s_norm, layer.wqkv_scale, layer.wqkv_bias, positions, cos, sin, slots,
                                     q, keys, values, H, KV, layer.q_norm, layer.k_norm, eps)
            triton_attention.tree_attention(q, keys, values, attn, starts, depths, table_rows, b.ancestors, ancestors_at,
                                   table, H, pool.block_tokens, b.attention_scratch, b.max_keys)
            triton_layers.quant_rows(attn, x_attn, s_attn)
            self.gemm(x_attn, layer.wo, acc_model)
            triton_layers.residual_norm_quant(h, layer.ffn_norm, eps, x_norm, s_norm,
                                        acc=acc_model, acc_scale=s_attn, w_scale=layer.wo_scale)
            self.gemm(x_norm, layer.w13, acc_ffn)
            triton_layers.swiglu(acc_ffn, s_norm, layer.w13_scale, ffn, layer.hadamard)
            triton_layers.quant_rows(ffn, x_ffn, s_ffn)
            self.gemm(x_ffn, layer.w2, acc_model)
        triton_layers.residual_norm_quant(h, model.norm.weight, eps, x_norm, s_norm,
                                    acc=acc_model, acc_scale=s_ffn, w_scale=layers[-1].w2_scale)
        picked = b.field("out_rows", head_rows)
        x_head, s_head = b.x_head[:head_rows], b.s_head[:head_rows]
        torch.index_select(x_norm, 0, picked, out=x_head)
        torch.index_select(s_norm, 0, picked, out=s_head)
        acc_head, logits = b.acc_head[:head_rows], b.logits[:head_rows]
        self.gemm(x_head, model.output.weight_chunks[0], acc_head)
        triton_layers.dequant(acc_head, s_head, model.output.weight_scale, logits)

    def _capture(self, buffers: _Buffers, rows: int, pool: KVPool) -> None:
        """Captures the step of `rows` rows (just run eagerly, so every kernel is compiled and
        every library handle made); later steps of that bucket replay it."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # A private memory pool per graph (a shared one is released with the first graph that
        # goes): every tensor the step writes is a static buffer, so it stays nearly empty.
        with torch.cuda.graph(graph):
            self._run(buffers, rows, rows, pool)
        key = (id(pool), rows)
        self._graphs[key] = graph
        # A graph holds the pool's addresses: it goes with the pool.
        weakref.finalize(pool, self._graphs.pop, key, None)


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()


def _common_pool(items: list[StepInput]) -> KVPool:
    pools = {id(item.cache.pool): item.cache.pool for item in items if isinstance(item.cache, PagedCache)}
    if len(pools) != 1 or any(not isinstance(item.cache, PagedCache) for item in items):
        raise ValueError("the device engine runs sessions of one KVPool")
    pool = next(iter(pools.values()))
    if pool.kv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the device engine reads a pool of bf16, fp16 or fp32, got {pool.kv.dtype}")
    return pool
