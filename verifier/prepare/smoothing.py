"""Smoothing: moving activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose precision when a few input channels are much larger than the
rest (the row's scale is set by its largest channel). For a linear layer y = W x, dividing input
channel j by s_j and multiplying weight column j by s_j leaves y unchanged in exact arithmetic
while flattening x (SmoothQuant, Xiao et al. 2022). Here the division is never done at run time:
it is folded into whatever produces x, once, at load:

  * q/k/v and gate/up read an RMSNorm output: the norm's weight is divided by s;
  * down_proj reads silu(gate) * up: up_proj's output rows (weights) are divided by s;
  * o_proj reads attention's weighted sum of v: v_proj's output rows are divided by s. With grouped
    query attention every q head of a group reads the same v channel, so that channel has one
    factor, taken over all the o_proj input channels it feeds;
  * the LM head reads the final norm: the norm's weight is divided by s, and the head gets its own
    copy of the (tied) embedding table with columns times s; the embedding lookup keeps the original.

s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), with max|x_j| measured by a float forward over a
fixed calibration text at load (~650 tokens, one float forward) and alpha per layer kind, chosen
offline with bench/quant_quality.py. It runs after rotation.py, which removes most outliers of the
residual stream but cannot reach down_proj's input (a product of two projections). Nothing here changes how a row is quantized or summed, so
every bit-identity property of quant.py holds: the factors are constants of the loaded model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.quant import block_hadamard

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs
    from pardec.verifier.model.transformer import Transformer
    from pardec.verifier.model.tokenizer import ChatTokenizer

# Calibration text written for this project: code, prose and chat turns (the chat template's
# special tokens produce activations of their own). Fixed, so a model loads the same everywhere.
CALIBRATION_CODE = '''import json
from collections import defaultdict


def group_orders_by_customer(path: str) -> dict[str, list[dict]]:
    """Read one JSON order per line and group the orders by customer id, oldest first."""
    groups = defaultdict(list)
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                order = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"line {number}: {error}") from error
            groups[order["customer"]].append(order)
    for orders in groups.values():
        orders.sort(key=lambda order: (order["date"], order.get("id", 0)))
    return dict(groups)


class RingBuffer:
    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.items = [None] * capacity
        self.start = self.size = 0

    def push(self, item):
        end = (self.start + self.size) % len(self.items)
        self.items[end] = item
        if self.size < len(self.items):
            self.size += 1
        else:
            self.start = (self.start + 1) % len(self.items)
'''
CALIBRATION_PROSE = (
    "Rivers shape the land they cross. Over thousands of years a river carves its valley, carries "
    "sand and silt downstream and drops them where the current slows, building deltas, islands and "
    "fertile plains. Early towns grew along rivers because they offered water, food, and a road for "
    "trade; many of the largest cities of 2024 still stand on their banks. In 1869 the Suez Canal "
    "opened, cutting the voyage from London to Bombay by about 7,000 km (roughly 40%)."
)
CALIBRATION_CHATS = (
    ("What is the difference between a list and a tuple in Python?",
     "A list is mutable: you can append, remove or change its items. A tuple is immutable, so it "
     "can be used as a dictionary key, and it signals that the data should not change."),
    ("Give me three tips for a good night's sleep.",
     "1. Go to bed at the same time every day.\n2. Keep the bedroom dark, quiet and cool.\n"
     "3. Avoid caffeine and large meals in the evening."),
    ("Écris une phrase sur la mer.", "La mer scintille sous le soleil du matin."),
)


@dataclass(frozen=True)
class SmoothingAlphas:
    """Migration strength per layer kind: 0 leaves a layer as it is, 1 moves all of the
    activation range into the weights."""

    qkv: float = 0.3
    o: float = 0.3
    gate_up: float = 0.3
    down: float = 0.3
    head: float = 0.3

    def __post_init__(self):
        for name, value in vars(self).items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"smoothing alpha {name} must be in [0, 1], got {value}")


def calibration_token_lists(tokenizer: "ChatTokenizer") -> list[list[int]]:
    texts = [CALIBRATION_CODE, CALIBRATION_PROSE] + [
        tokenizer.render_chat([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
        for question, answer in CALIBRATION_CHATS
    ]
    return [tokenizer.encode(text) for text in texts]


@contextlib.contextmanager
def recording_inputs(module: torch.nn.Module, record: Callable[[str, torch.Tensor], None], prefix: str = ""):
    """While open, every linear layer of `module` calls ``record(prefix + its name, x)`` with its
    input rows x [T, in] as its weights see them: after the layer's online Hadamard transform, if
    any (rotation.py). The LM head ("output") is left out."""
    linears = [(name, child) for name, child in module.named_modules() if name != "output"
               and isinstance(getattr(child, "weight", None), torch.Tensor) and child.weight.dim() == 2]

    def seen_by_weights(child, x: torch.Tensor) -> torch.Tensor:
        block = getattr(child, "input_hadamard", 0)
        return block_hadamard(x.float(), block) if block else x

    handles = [child.register_forward_pre_hook(
        lambda child, inputs, name=name: record(prefix + name, seen_by_weights(child, inputs[0].detach())))
        for name, child in linears]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def run_calibration(float_model: "Transformer", token_lists: list[list[int]],
                    record: Callable[[str, torch.Tensor], None]) -> None:
    """Runs the float model over the calibration texts, calling ``record(name, x)`` with the
    input rows x [T, in] of every linear layer, by module name ("layers.0.attention.wqkv", ...,
    "output"), as recording_inputs gives them."""
    # The LM head reads the final norm of the last layer's output. Recording that here lets the
    # forward compute logits for one row only: the head is a fifth of the model's FLOPs.
    handle = float_model.layers[-1].register_forward_hook(
        lambda module, inputs, output: record("output", float_model.norm(output)))
    try:
        with recording_inputs(float_model, record):
            device = float_model.rope_cos.device
            for tokens in token_lists:
                tokens = tokens[: float_model.args.max_position]
                count = len(tokens)
                cache = KVCache(float_model.args, count, device=device)
                cache.reserve(count)
                float_model(torch.tensor(tokens, device=device), torch.arange(count, device=device),
                            torch.ones(count, count, dtype=torch.bool, device=device).tril(), cache,
                            output_rows=torch.tensor([count - 1], device=device))
    finally:
        handle.remove()


def _factors(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    # Floors keep channels that calibration never saw, or all-zero columns, finite and unscaled-ish.
    factors = act_max.clamp_min(1e-5).pow(alpha) / weight_max.clamp_min(1e-5).pow(1 - alpha)
    return factors.clamp(1e-4, 1e4)


def smoothing_factors(args: "ModelArgs", tensors: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor],
                      alphas: SmoothingAlphas = SmoothingAlphas()) -> dict[str, torch.Tensor]:
    """Per linear layer that reads smoothed inputs (module names, as in ``maxima``), the factor s
    [in] that its input channels are divided by. Depends only on the weights before smoothing."""
    factors = {}
    for layer in range(args.n_layers):
        factors |= layer_smoothing_factors(args, tensors, maxima, layer, alphas)
    return factors | head_smoothing_factors(tensors, maxima, alphas)


def layer_smoothing_factors(args: "ModelArgs", tensors: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor],
                            layer: int, alphas: SmoothingAlphas = SmoothingAlphas()) -> dict[str, torch.Tensor]:
    """smoothing_factors of decoder layer `layer` alone."""
    factors = {}
    group = args.n_heads // args.n_kv_heads
    p = f"layers.{layer}"
    q, k, v = (f"{p}.attention.w{name}" for name in "qkv")
    o, gate, up, down = f"{p}.attention.wo", f"{p}.feed_forward.w1", f"{p}.feed_forward.w3", f"{p}.feed_forward.w2"
    if alphas.qkv:
        weight_max = torch.cat([tensors[f"{n}.weight"] for n in (q, k, v)]).abs().amax(dim=0)
        factors[f"{p}.attention.wqkv"] = _factors(maxima[f"{p}.attention.wqkv"], weight_max, alphas.qkv)
    if alphas.o:
        # o_proj input channel (head h, d) reads v channel (h // group, d): one factor per v
        # channel, repeated over the q heads of its group.
        shape = (args.n_kv_heads, group, args.head_dim)
        act_max = maxima[o].view(shape).amax(dim=1).flatten()
        weight_max = tensors[f"{o}.weight"].abs().amax(dim=0).view(shape).amax(dim=1).flatten()
        per_v = _factors(act_max, weight_max, alphas.o)
        factors[o] = per_v.view(args.n_kv_heads, 1, args.head_dim).expand(shape).flatten()
    if alphas.gate_up:
        weight_max = torch.cat([tensors[f"{gate}.weight"], tensors[f"{up}.weight"]]).abs().amax(dim=0)
        factors[f"{p}.feed_forward.w13"] = _factors(maxima[f"{p}.feed_forward.w13"], weight_max, alphas.gate_up)
    # Smoothing down_proj's input folds into up_proj's rows, which an online Hadamard
    # transform between them (rotation.py) would mix: such a layer is not smoothed.
    if alphas.down and f"{down}.input_hadamard" not in tensors:
        factors[down] = _factors(maxima[down], tensors[f"{down}.weight"].abs().amax(dim=0), alphas.down)
    return factors


def head_smoothing_factors(tensors: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor],
                           alphas: SmoothingAlphas = SmoothingAlphas()) -> dict[str, torch.Tensor]:
    """smoothing_factors of the LM head alone ({} or {"output": s})."""
    if not alphas.head:
        return {}
    head = tensors["output.weight"] if "output.weight" in tensors else tensors["tok_embeddings.weight"]
    # The column maxima a block of rows at a time: no |head| the size of a vocabulary-sized table.
    column_max = torch.stack([block.abs().amax(dim=0) for block in head.split(4096)]).amax(dim=0)
    return {"output": _factors(maxima["output"], column_max, alphas.head)}


def smooth(args: "ModelArgs", tensors: dict[str, torch.Tensor], factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` (gpt-fast names) with ``factors`` (smoothing_factors) folded in. In
    exact arithmetic the float model computes the same function; only the split of range between
    activations and weights changes. Leaves the input dict untouched."""
    out = dict(tensors)
    for layer in range(args.n_layers):
        smooth_layer(args, out, factors, layer)
    smooth_head(out, factors)
    return out


def smooth_layer(args: "ModelArgs", out: dict[str, torch.Tensor], factors: dict[str, torch.Tensor], layer: int) -> None:
    """Folds decoder layer `layer`'s factors into ``out``'s tensors (replacing, never changing in place)."""
    group = args.n_heads // args.n_kv_heads
    p = f"layers.{layer}"
    q, k, v = (f"{p}.attention.w{name}" for name in "qkv")
    o, gate, up, down = f"{p}.attention.wo", f"{p}.feed_forward.w1", f"{p}.feed_forward.w3", f"{p}.feed_forward.w2"
    if (s := factors.get(f"{p}.attention.wqkv")) is not None:
        out[f"{p}.attention_norm.weight"] = out[f"{p}.attention_norm.weight"] / s
        for name in (q, k, v):
            out[f"{name}.weight"] = out[f"{name}.weight"] * s
    if (s := factors.get(o)) is not None:
        per_v = s.view(args.n_kv_heads, group, args.head_dim)[:, 0].flatten()
        out[f"{v}.weight"] = out[f"{v}.weight"] / per_v[:, None]
        if f"{v}.bias" in out:
            out[f"{v}.bias"] = out[f"{v}.bias"] / per_v
        out[f"{o}.weight"] = out[f"{o}.weight"] * s
    if (s := factors.get(f"{p}.feed_forward.w13")) is not None:
        out[f"{p}.ffn_norm.weight"] = out[f"{p}.ffn_norm.weight"] / s
        out[f"{gate}.weight"] = out[f"{gate}.weight"] * s
        out[f"{up}.weight"] = out[f"{up}.weight"] * s
    if (s := factors.get(down)) is not None:
        out[f"{up}.weight"] = out[f"{up}.weight"] / s[:, None]
        out[f"{down}.weight"] = out[f"{down}.weight"] * s


def smooth_head(out: dict[str, torch.Tensor], factors: dict[str, torch.Tensor], own_head: bool = False) -> None:
    """Folds the LM head's factor into ``out``: the final norm and a head of its own. own_head:
    out's "output.weight" is the caller's own copy, scaled in place (the same bits, without a
    second vocabulary-sized matrix)."""
    if (s := factors.get("output")) is not None:
        head = out["output.weight"] if "output.weight" in out else out["tok_embeddings.weight"]
        out["norm.weight"] = out["norm.weight"] / s
        out["output.weight"] = head.mul_(s) if own_head and "output.weight" in out else head * s
