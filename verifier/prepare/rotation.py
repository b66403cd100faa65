"""Rotating the residual stream so that W8A8 quantization sees no outlier channels.

A few residual channels of a transformer carry values far larger than the rest; per-token int8
activations then spend their range on those channels and round the others coarsely. Multiplying
the residual stream by an orthogonal matrix Q spreads every channel over all of them, and the
model computes exactly the same function once Q is folded into the weights (QuaRot, Ashkboos et
al. 2024; SliceGPT's "computational invariance"):

  * RMSNorm(x Q) = RMSNorm(x) Q when the norm has no weight, because ||x Q|| = ||x||: so each
    norm's weight g is first folded into the layers that read it (W diag(g)), then the norm gets
    all-ones weight;
  * layers reading the residual get W diag(g) Q; layers writing to it (o_proj, down_proj) get
    Q^T W; the embedding table becomes E Q, and the LM head its own copy E diag(g_final) Q;
  * per attention head, v_proj's output rows and o_proj's matching input columns get a second,
    head_dim-sized rotation, which flattens o_proj's input (attention mixes v rows only);
  * down_proj's input, silu(gate) * up, is not linear in anything a weight can absorb, so it is
    rotated online (QuaRot's online Hadamard): every forward applies `block_hadamard` to it, and
    down_proj's weight gets the inverse, W H / 64. The marker "<layer>.feed_forward.w2.input_hadamard"
    in the tensors tells transformer.py to apply it. Measured with bench.quant_quality (GPTQ, native
    kernels): top-1 agreement with the float model 0.974 -> 0.979 on HumanEval and 0.966 -> 0.977 on
    MT-Bench; blocks of 512 gave 0.980 and 0.974, at half again the work.

Q comes from `orthogonal_matrix`: fixed for a given size.
Everything here happens once at load on the float weights; the quantized model's arithmetic is
unchanged, so it keeps every bit-identity property of quant.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from pardec.verifier.model.quant import block_hadamard
from pardec.verifier.prepare.workers import ONE, Workers

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs

RESIDUAL_SEED, HEAD_SEED = 0, 1
# Block of the online Hadamard transform of down_proj's input (a power of two dividing ffn_dim).
DOWN_HADAMARD_BLOCK = 64
# Rows of the embedding table or LM head rotated per GEMM.
ROW_BLOCK = 4096


def _hadamard(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix, normalized to be orthogonal; size is a power of two."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / math.sqrt(size)


def orthogonal_matrix(size: int, seed: int) -> torch.Tensor:
    """A fixed fp32 orthogonal [size, size] matrix Q = diag(signs) (M kron H) that mixes every
    coordinate into all of them: H is Sylvester's Hadamard matrix of the largest power-of-two
    factor of size, M a seeded random orthogonal matrix of the rest. (Applying it through that
    structure was measured no faster than one dense GEMM, 0.40 vs 0.39 s for the 49152-row table.)"""
    generator = torch.Generator().manual_seed(seed)
    power_of_two = size & -size
    rest = size // power_of_two
    # QR of a Gaussian matrix; the sign fix makes M a function of the seed alone.
    q, r = torch.linalg.qr(torch.randn(rest, rest, generator=generator, dtype=torch.float64))
    mixing = (q * torch.sign(torch.diagonal(r))).contiguous()
    signs = torch.randint(0, 2, (size,), generator=generator).double() * 2 - 1
    return (signs[:, None] * torch.kron(mixing, _hadamard(power_of_two))).float()


def rotations(args: "ModelArgs") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's Q [dim, dim] and the per-head rotation of v and o [head_dim, head_dim]."""
    return orthogonal_matrix(args.dim, RESIDUAL_SEED), orthogonal_matrix(args.head_dim, HEAD_SEED)


def rotate(args: "ModelArgs", tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` (gpt-fast names) for the rotated model: the same function in exact
    arithmetic, with every norm weight folded away and a separate "output.weight" head."""
    rotation, head_rotation = rotations(args)
    out = dict(tensors)
    out.update(rotate_ends(tensors, rotation))
    for layer in range(args.n_layers):
        out.update(rotate_layer(args, tensors, layer, rotation, head_rotation))
    return out


def rotate_ends(tensors: dict[str, torch.Tensor], rotation: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rotated embedding table, final norm and LM head."""
    return rotate_embedding(tensors, rotation) | rotate_head(tensors, rotation)


def rotate_embedding(tensors: dict[str, torch.Tensor], rotation: torch.Tensor,
                     workers: Workers = ONE) -> dict[str, torch.Tensor]:
    """The rotated embedding table and the final norm's weight (ones: folded into the head)."""
    return {"tok_embeddings.weight": _rotate_rows(tensors["tok_embeddings.weight"], None, rotation, workers),
            "norm.weight": torch.ones_like(tensors["norm.weight"])}


def rotate_head(tensors: dict[str, torch.Tensor], rotation: torch.Tensor,
                workers: Workers = ONE) -> dict[str, torch.Tensor]:
    """The LM head of its own, E diag(g_final) Q (E the embedding table when the head is tied)."""
    head = tensors["output.weight"] if "output.weight" in tensors else tensors["tok_embeddings.weight"]
    return {"output.weight": _rotate_rows(head, tensors["norm.weight"].float(), rotation, workers)}


def _rotate_rows(matrix: torch.Tensor, column_scale: torch.Tensor | None, rotation: torch.Tensor,
                 workers: Workers = ONE) -> torch.Tensor:
    """(matrix diag(column_scale)) Q in fp32, ROW_BLOCK rows at a time (blocks spread over
    ``workers``): a vocabulary-sized table is never held in float beside its result (its source
    may be bf16 or int8-dequantized fp32)."""
    out = torch.empty(matrix.shape[0], rotation.shape[1], dtype=torch.float32)

    def block_of(first: int) -> None:
        block = matrix[first : first + ROW_BLOCK].float()
        torch.matmul(block if column_scale is None else block * column_scale, rotation, out=out[first : first + ROW_BLOCK])

    workers.map(block_of, range(0, matrix.shape[0], ROW_BLOCK))
    return out


def rotate_layer(args: "ModelArgs", tensors: dict[str, torch.Tensor], layer: int, rotation: torch.Tensor,
                 head_rotation: torch.Tensor, workers: Workers = ONE) -> dict[str, torch.Tensor]:
    """Decoder layer `layer`'s rotated tensors: those rotation changes, each read once (its seven
    matrices' products spread over ``workers``)."""
    prefix = f"layers.{layer}"
    out = {}

    readers = {"attention_norm": ("attention.wq", "attention.wk", "attention.wv"),
               "ffn_norm": ("feed_forward.w1", "feed_forward.w3")}
    products = [(name, tensors[f"{prefix}.{norm}.weight"]) for norm, names in readers.items() for name in names]
    products += [(name, None) for name in ("attention.wo", "feed_forward.w2")]

    def rotated(product: tuple[str, torch.Tensor | None]) -> torch.Tensor:
        name, norm_weight = product
        weight = tensors[f"{prefix}.{name}.weight"].float()
        # Layers reading the residual: W diag(g) Q; layers writing to it: Q^T W.
        return (weight * norm_weight.float()) @ rotation if norm_weight is not None else rotation.T @ weight

    for (name, _), result in zip(products, workers.map(rotated, products)):
        out[f"{prefix}.{name}.weight"] = result
    for norm in readers:
        out[f"{prefix}.{norm}.weight"] = torch.ones_like(tensors[f"{prefix}.{norm}.weight"])

    # v' = v R per kv head, so v_proj rows become R^T W_v; o_proj undoes it with W_o R per q head.
    v_key, v_bias_key, o_key = f"{prefix}.attention.wv.weight", f"{prefix}.attention.wv.bias", f"{prefix}.attention.wo.weight"
    v_weight = out[v_key].view(args.n_kv_heads, args.head_dim, args.dim)
    out[v_key] = (head_rotation.T @ v_weight).reshape(-1, args.dim)
    if v_bias_key in tensors:
        out[v_bias_key] = (tensors[v_bias_key].float().view(args.n_kv_heads, args.head_dim) @ head_rotation).flatten()
    o_weight = out[o_key].view(args.dim, args.n_heads, args.head_dim)
    out[o_key] = (o_weight @ head_rotation).reshape(args.dim, args.q_dim)

    # down_proj reads block_hadamard(h) = h H; W' = W H / block (H H = block I, H symmetric),
    # i.e. each row of W transformed, in fp64. Dividing by a power of two is exact.
    if args.ffn_dim % DOWN_HADAMARD_BLOCK == 0:
        down_key = f"{prefix}.feed_forward.w2.weight"
        out[down_key] = (block_hadamard(out[down_key].double(), DOWN_HADAMARD_BLOCK) / DOWN_HADAMARD_BLOCK).float()
        out[f"{prefix}.feed_forward.w2.input_hadamard"] = torch.tensor(DOWN_HADAMARD_BLOCK)
    return out
