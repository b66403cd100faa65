"""A Llama / Qwen2 decoder for speculative tree verification on CPU.

One forward pass scores a whole candidate tree: T step tokens (the root first, then the tree nodes)
attend to the session's committed KV cache and to their own ancestors in the step. The step's keys
and values go into the cache right after the committed positions; `commit` then keeps the accepted
path and drops the rest (see kvcache.py). `forward_batch` does this for several sessions at once:
their rows are packed for every per-row op and linear layer, attention runs per session.

Greedy tree decoding is only lossless if a token's logits do not depend on which other tokens share
its forward pass. Every op here is therefore per-row or exact (see quant.py): embedding lookup,
RMSNorm and rotary are row-wise, linear layers are W8A8 with exact integer accumulation, and
attention on CPU runs in fp32 in a kernel whose reduction order is fixed per row
(native_attention.py); without a C compiler, and on other devices, it runs in float64, whose
summation-order noise is far below anything that survives the fp32 rounding and int8
quantization that follow it (attention.py). Devices without fp64 (Ascend NPUs, ascend.py) run
attention, norms and SwiGLU in fp32 with every reduction in a fixed order (fixed_order.py).

With the CPU's C kernels (the native W8A8 GEMM and attention), the norms and SwiGLU are C too, and
a forward over a KVPool runs each decoder layer as one C call (native_layers.py) instead of the
modules below; both compute the same bits, the call only saves the modules' Python and torch
dispatch, about half of a 1-token step.
"""

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pardec.verifier.kernels import native_attention, native_linear
from pardec.verifier.config import ATTENTION_KERNELS
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool, PagedCache
from pardec.verifier.model.native_layers import FusedLayers
from pardec.verifier.model.step import StepInput, StepPlan
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.fixed_order import FixedOrderOps
from pardec.verifier.model.quant import W8A8Linear, block_hadamard
from pardec.verifier.model.rotary import apply_rotary, rotary_tables
from pardec.verifier.model.static_quant import StackedLinears, StaticW8A8Linear, dequantized, input_quantization

if TYPE_CHECKING:
    from pardec.verifier.kernels.native_linear import NativeLinear

QUANTIZATIONS = ("w8a8", "none")


def triton_available() -> bool:
    """True when Triton imports here (it ships with torch's CUDA builds)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


EMBEDDING_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def embedding_table(table: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, bool]:
    """The embedding table [vocab, dim] as the model keeps it, and whether an entry was rounded to
    fit: in ``dtype`` (rounded to nearest even), or with None in the narrowest of bf16, fp16 and
    fp32 that holds every entry exactly. A checkpoint used as stored (compressed-tensors,
    msModelSlim) keeps its bf16 or fp16 table at half fp32's bytes with the same numbers; a
    prepared one's rotated table needs fp32 for that.

    >>> [(t.dtype, rounded) for t, rounded in (embedding_table(torch.tensor([[1.0, 0.5]])),
    ...                                        embedding_table(torch.tensor([[1.0, 0.1]])))]
    [(torch.bfloat16, False), (torch.float32, False)]
    >>> embedding_table(torch.tensor([[1.0, 1 + 2 ** -10]]))[0].dtype  # fp16's 10 mantissa bits, not bf16's 7
    torch.float16
    >>> embedding_table(torch.tensor([[1.0, 0.1]]), torch.bfloat16)
    (tensor([[1.0000, 0.1001]], dtype=torch.bfloat16), True)
    """
    if dtype is not None and dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"embedding_dtype must be None or one of {list(EMBEDDING_DTYPES)}, got {dtype}")
    if dtype is None and table.dtype in EMBEDDING_DTYPES[:-1]:
        return table.contiguous(), False  # already the narrowest: every entry is its own

    def holds(narrow: torch.dtype) -> bool:
        # A slice of rows at a time: a whole copy of a large vocabulary's table is most of a gigabyte.
        return all(torch.equal(part.to(narrow).float(), part.float()) for part in table.split(4096))

    if dtype is not None:
        return table.to(dtype).contiguous(), not holds(dtype)
    for narrow in EMBEDDING_DTYPES[:-1]:
        if holds(narrow):
            return table.to(narrow).contiguous(), False
    return table.float().contiguous(), False


class FloatLinear(nn.Module):
    """Plain fp32 linear: the correctness oracle against transformers, not batch invariant."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                 input_hadamard: int = 0):
        super().__init__()
        # weight_scale: an int8 checkpoint's per-output-channel scale; its float layer dequantizes.
        weight = weight.float() if weight_scale is None else weight.float() * weight_scale.float().view(-1, 1)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.input_hadamard = input_hadamard  # quant.block_hadamard's block for the input, 0: none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.input_hadamard:
            x = block_hadamard(x, self.input_hadamard)
        return F.linear(x, self.weight, self.bias)


def linear_factory(quantization: str, kernel: str, ascend=None) -> Callable[..., nn.Module]:
    """Builds every linear layer of a model: W8A8 with the chosen exact kernel, or float."""
    if quantization == "w8a8":
        return lambda weight, bias=None, weight_scale=None, input_hadamard=0: W8A8Linear(
            weight, bias, kernel, weight_scale, input_hadamard, ascend)
    return FloatLinear


def weight_scales(tensors: dict[str, torch.Tensor], layers: list[str]) -> torch.Tensor | None:
    """The stored per-channel scales of (fused) layers of an int8 checkpoint, None for float ones."""
    if f"{layers[0]}.weight_scale" not in tensors:
        return None
    return torch.cat([tensors[f"{layer}.weight_scale"].float().flatten() for layer in layers])


def static_factory(quantization: str, kernel: str, ascend=None) -> Callable[..., nn.Module]:
    """Builds the static W8A8 layers of an msModelSlim checkpoint (static_quant.py): as stored for
    w8a8, their dequantized float function for "none"."""
    if quantization == "w8a8":
        return lambda tensors, prefixes: StaticW8A8Linear.from_tensors(tensors, prefixes, kernel, ascend)
    return lambda tensors, prefixes: FloatLinear(*dequantized(tensors, prefixes))


def _kind(tensors, prefix: str) -> str:
    if f"{prefix}.deq_scale" in tensors:
        return "static"
    return "int8" if f"{prefix}.weight_scale" in tensors else "float"


def build_linear(tensors, prefixes: list[str], linear: Callable[..., nn.Module], static: Callable[..., nn.Module],
                 input_hadamard: int = 0) -> nn.Module:
    """The layers `prefixes` (q/k/v, gate/up, or one) as one module over their shared input row:
    one layer when they are of one kind (float, int8 with weight_scale, or static with the same
    input scale and offset), else side by side. A static layer's stored float bias is folded into
    its quant_bias; any other layer's "<prefix>.bias" is added (zeros for parts without one)."""
    kinds = {_kind(tensors, prefix) for prefix in prefixes}
    if kinds == {"static"}:
        if len({input_quantization(tensors, prefix) for prefix in prefixes}) == 1:
            return static(tensors, prefixes)
    elif len(kinds) == 1:
        weights = [tensors[f"{prefix}.weight"] for prefix in prefixes]
        bias = None
        if any(f"{prefix}.bias" in tensors for prefix in prefixes):
            bias = torch.cat([tensors[f"{prefix}.bias"].float() if f"{prefix}.bias" in tensors
                              else torch.zeros(weight.shape[0]) for prefix, weight in zip(prefixes, weights)])
        return linear(torch.cat(weights), bias, weight_scales(tensors, prefixes), input_hadamard=input_hadamard)
    return StackedLinears([build_linear(tensors, [prefix], linear, static) for prefix in prefixes])


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, kernels: "NativeLinear | None" = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        # msModelSlim's anti-outlier smoothing adds a bias after the norm (an elementwise add).
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.eps = eps
        self.kernels = kernels  # the CPU engine's C ops (decoder_layer.c), None: torch's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, dim]. Each row is reduced on its own by the same kernel whatever T is;
        # tests/test_model.py checks a row comes out bit-identical for T = 1 and T = n.
        if self.kernels is not None:
            out = self.kernels.rms_norm(x, self.weight, self.eps)
        else:
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out if self.bias is None else out + self.bias


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, tensors: dict[str, torch.Tensor], prefix: str, linear: Callable[..., nn.Module],
                 kernels: "NativeLinear | None" = None, static: Callable[..., nn.Module] | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v read the same activation row, so one fused W8A8 layer gives bit-identical
        # results to three separate ones (per-channel weight scales, per-row activation scale).
        self.wqkv = build_linear(tensors, [f"{prefix}.w{name}" for name in "qkv"], linear, static)
        self.wo = build_linear(tensors, [f"{prefix}.wo"], linear, static)
        # Qwen3: each head's q and k normalized on its own, a row-wise op like every norm here.
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(tensors[f"{prefix}.q_norm.weight"], args.norm_eps, kernels)
            self.k_norm = RMSNorm(tensors[f"{prefix}.k_norm.weight"], args.norm_eps, kernels)

    def forward(self, x, cos, signed_sin, layer: int, plan: StepPlan):
        # x: [N, dim], the packed rows of every session in the step; the plan says whose rows are whose.
        rows = x.shape[0]
        qkv = self.wqkv(x).view(rows, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        qk = qkv[:, : self.n_heads + self.n_kv_heads]
        if self.q_norm is not None:
            q = self.q_norm(qk[:, : self.n_heads].reshape(-1, self.head_dim)).view(rows, self.n_heads, -1)
            k = self.k_norm(qk[:, self.n_heads :].reshape(-1, self.head_dim)).view(rows, self.n_kv_heads, -1)
            qk = torch.cat([q, k], dim=1)
        # q and k are adjacent in the fused output: one rotary call covers both.
        qk = apply_rotary(qk, cos, signed_sin)
        kv = torch.cat([qk[:, self.n_heads :], qkv[:, self.n_heads + self.n_kv_heads :]], dim=1)
        # Attention is the one per-session op: each session has its own cache and tree mask.
        # Its fp64 output goes to W8A8 directly, see quant.quantize_activation.
        return self.wo(plan.attention(layer, qk[:, : self.n_heads], kv))


class FeedForward(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str, linear: Callable[..., nn.Module],
                 kernels: "NativeLinear | None" = None, static: Callable[..., nn.Module] | None = None):
        super().__init__()
        self.kernels = kernels
        # gate (w1) and up (w3) share their input row, so fusing them is exact, as for wqkv.
        self.w13 = build_linear(tensors, [f"{prefix}.w1", f"{prefix}.w3"], linear, static)
        # rotation.py may rotate down_proj's input online (its block size stored with the weights).
        hadamard = tensors.get(f"{prefix}.w2.input_hadamard")
        self.w2 = build_linear(tensors, [f"{prefix}.w2"], linear, static,
                               input_hadamard=0 if hadamard is None else int(hadamard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13(x)
        if self.kernels is not None:
            return self.w2(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, tensors: dict[str, torch.Tensor], layer: int, linear: Callable[..., nn.Module],
                 kernels: "NativeLinear | None" = None, static: Callable[..., nn.Module] | None = None):
        super().__init__()
        prefix = f"layers.{layer}"
        self.attention_norm = RMSNorm(tensors[f"{prefix}.attention_norm.weight"], args.norm_eps, kernels,
                                      tensors.get(f"{prefix}.attention_norm.bias"))
        self.attention = Attention(args, tensors, f"{prefix}.attention", linear, kernels, static)
        self.ffn_norm = RMSNorm(tensors[f"{prefix}.ffn_norm.weight"], args.norm_eps, kernels,
                                tensors.get(f"{prefix}.ffn_norm.bias"))
        self.feed_forward = FeedForward(tensors, f"{prefix}.feed_forward", linear, kernels, static)

    def forward(self, x, cos, signed_sin, layer, plan):
        h = x + self.attention(self.attention_norm(x), cos, signed_sin, layer, plan)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(
        self, args: ModelArgs, tensors: dict[str, torch.Tensor], quantization: str = "w8a8", kernel: str = "fp32_exact",
        attention: str = "auto", ascend=None, kv_dtype: torch.dtype | None = None,
        embedding_dtype: torch.dtype | None = None,
    ):
        """ascend: the Ascend ops (ascend.AscendOps) of the npu_quant_matmul kernel. kv_dtype: what
        its KV pools store, None for the forward's own (fp32; the device engine's bf16); bf16 on CPU
        halves the cache, each key and value rounded once as it is stored. embedding_dtype: what
        the embedding table is kept in (embedding_table)."""
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        if kv_dtype not in (None, *native_attention.KV_DTYPES):
            raise ValueError(f"kv_dtype must be None or one of {list(native_attention.KV_DTYPES)}, got {kv_dtype}")
        self._kv_dtype = kv_dtype
        self.native_attention = None
        if attention in ("auto", "native") and args.head_dim % native_attention.LANES == 0:
            self.native_attention = native_attention.load(kv_dtype=kv_dtype or torch.float32)
        if attention == "native" and self.native_attention is None:
            raise RuntimeError(f"attention 'native' needs a C compiler and head_dim a multiple of {native_attention.LANES}")
        if attention in ("triton", "fixed_order"):
            self.attention = attention
        else:
            self.attention = "native" if self.native_attention is not None else "fp64"
        self.args, self.quantization = args, quantization
        self.kernel = kernel if quantization == "w8a8" else "float"
        ascend = ascend if self.kernel == "npu_quant_matmul" else None
        linear = linear_factory(quantization, kernel, ascend)
        # With the CPU attention kernel come the C norm and SwiGLU, so that every path of the
        # engine (fused layers or modules, any linear kernel) computes the same bits; with the
        # fixed-order attention, its fixed-order norm and SwiGLU.
        kernels = native_linear.load() if self.attention == "native" else None
        if self.attention == "fixed_order":
            kernels = FixedOrderOps()
        # The embedding is a lookup, row-wise by nature: kept float, each row widened to fp32 as it is read.
        table, self.embedding_rounded = embedding_table(tensors["tok_embeddings.weight"], embedding_dtype)
        self.tok_embeddings = nn.Parameter(table, requires_grad=False)
        del table
        static = static_factory(quantization, kernel, ascend)
        self.layers = nn.ModuleList(TransformerBlock(args, tensors, i, linear, kernels, static)
                                    for i in range(args.n_layers))
        self.norm = RMSNorm(tensors["norm.weight"], args.norm_eps, kernels, tensors.get("norm.bias"))
        # A tied head gets its own "output.weight" once rotation.py and smoothing.py rescale it.
        if "output.weight" in tensors:
            self.output = build_linear(tensors, ["output"], linear, static)
        else:  # from the table as kept (no second read of a large one), unless it was rounded to fit
            self.output = linear(tensors["tok_embeddings.weight"] if self.embedding_rounded
                                 else self.tok_embeddings.detach())
        cos, signed_sin = rotary_tables(args, tensors.get("rope_freqs"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin, persistent=False)
        # Every decoder layer in one C call when all its parts are the CPU kernels (native_layers.py).
        self.fused_layers = None
        # (Its C layer has no norm biases or static W8A8 layers: msModelSlim checkpoints with those
        # run the modules.)
        if self.attention == "native" and self.kernel == "native" and self._plain_layers():
            self.fused_layers = FusedLayers(self, kernels, self.native_attention)
        # The device engine (device_forward.py) serves sessions in a pool of its key/value dtype;
        # a KVCache of one session (tests, tools) still runs the modules, with fp64 attention.
        self.device_forward = None
        if self.attention == "triton":
            if quantization != "w8a8" or kernel != "int_mm":
                raise ValueError("attention 'triton' is the device engine: it needs w8a8 with the int_mm kernel")
            if not self._plain_layers():
                raise ValueError("the device engine has no static W8A8 layers or norm biases (an msModelSlim "
                                 "checkpoint): serve it with --device cpu")
            from pardec.verifier.model.device_forward import DeviceForward

            self.device_forward = DeviceForward(self)
            if kv_dtype not in (None, torch.bfloat16):
                raise ValueError(f"the device engine stores keys and values in bf16, not {kv_dtype}")

    def _plain_layers(self) -> bool:
        """No norm bias and every decoder linear one W8A8 or float layer (what the fused paths run)."""
        for block in self.layers:
            if any(norm.bias is not None for norm in (block.attention_norm, block.ffn_norm)):
                return False
            linears = (block.attention.wqkv, block.attention.wo, block.feed_forward.w13, block.feed_forward.w2)
            if any(isinstance(linear, (StaticW8A8Linear, StackedLinears)) for linear in linears):
                return False
        return self.norm.bias is None and not isinstance(self.output, (StaticW8A8Linear, StackedLinears))

    @property
    def kv_dtype(self) -> torch.dtype:
        """What a KVPool for this model stores: as asked, else bf16 for the device engine and fp32."""
        if self._kv_dtype is not None:
            return self._kv_dtype
        if self.device_forward is not None:
            from pardec.verifier.model.device_forward import KV_DTYPE

            return KV_DTYPE
        return torch.float32

    def new_pool(self, capacity_tokens: int, block_tokens: int, device=None) -> KVPool:
        """A KVPool on the model's device in the dtype its forward reads."""
        return KVPool(self.args, capacity_tokens, block_tokens, device or self.norm.weight.device, self.kv_dtype)

    @torch.no_grad()
    def forward(self, tokens, depths, ancestors, cache: KVCache, output_rows=None) -> torch.Tensor:
        # tokens, depths: int64 [T]; ancestors: bool [T, T] -> logits fp32 [T or len(output_rows), vocab]
        return self.forward_batch([StepInput(tokens, depths, ancestors, cache, output_rows)])[0]

    @torch.no_grad()
    def forward_batch(self, items: "list[StepInput]") -> list[torch.Tensor]:
        """One forward for the steps of several sessions: embedding, norms, rotary and every linear
        layer run once over all their rows packed together (row-invariant, so each row comes out
        as if alone), attention per session or per group of small steps (step.py). Returns each
        item's logits, in order."""
        if self.device_forward is not None and all(isinstance(item.cache, PagedCache) for item in items):
            return self.device_forward.forward_batch(items)
        plan = StepPlan.build(items, self.native_attention, fixed_order=self.attention == "fixed_order")
        segments = plan.segments
        positions = torch.cat([segment.start + item.depths for segment, item in zip(segments, items)])
        h = self.tok_embeddings[torch.cat([item.tokens for item in items])].float()
        if self.fused_layers is not None and self.fused_layers.can_run(plan):
            h = self.fused_layers.run(h, positions, plan)
        else:
            cos, signed_sin = self.rope_cos[positions][:, None], self.rope_signed_sin[positions][:, None]
            for index, layer in enumerate(self.layers):
                h = layer(h, cos, signed_sin, index, plan)

        picked, counts = [], []
        for segment, item in zip(segments, items):
            rows = torch.arange(segment.steps, device=h.device) if item.output_rows is None else item.output_rows
            picked.append(segment.offset + torch.as_tensor(rows, device=h.device).view(-1))
            counts.append(picked[-1].numel())
        picked = torch.cat(picked)
        if picked.numel() == h.shape[0] and bool((picked == torch.arange(h.shape[0], device=h.device)).all()):
            selected = h
        else:
            selected = h[picked]
        logits = self.output(self.norm(selected)) if picked.numel() else h.new_zeros(0, self.args.vocab_size)
        return list(logits.split(counts))
