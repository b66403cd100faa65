"""Decoders of real size with random weights, made on the device that runs them: nothing is
downloaded, and a 7-8B model never passes through host memory in fp32.

The shapes are the published configs' (config.json of each model on the Hugging Face hub):

| shape | layers | width | heads / kv heads | head_dim | FFN | vocab |
|---|---:|---:|---:|---:|---:|---:|
| SmolLM2-135M (the bundled model) | 30 | 576 | 9 / 3 | 64 | 1536 | 49152 |
| Llama-3-8B | 32 | 4096 | 32 / 8 | 128 | 14336 | 128256 |
| Qwen2.5-7B (q/k/v biases) | 28 | 3584 | 28 / 4 | 128 | 18944 | 152064 |
| Qwen3-8B (per-head q/k RMSNorms) | 36 | 4096 | 32 / 8 | 128 | 12288 | 151936 |

max_position is capped at 8192 (the longest context measured is far below it; the attention
scratch is sized by it).

The weights are round-to-nearest W8A8 (no rotation, smoothing or GPTQ: random weights have no
outliers to move), through the same W8A8Linear as a served checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.checkpoint import Checkpoint

MAX_POSITION = 8192

SHAPES = {
    "SmolLM2-135M": ModelArgs("llama", 49152, 576, 30, 9, 3, 1536, 100000.0, 1e-5, MAX_POSITION, True, False),
    "Llama-3-8B": ModelArgs("llama", 128256, 4096, 32, 32, 8, 14336, 500000.0, 1e-5, MAX_POSITION, False, False),
    "Qwen2.5-7B": ModelArgs("qwen2", 152064, 3584, 28, 28, 4, 18944, 1000000.0, 1e-6, MAX_POSITION, False, True),
    "Qwen3-8B": ModelArgs("qwen3", 151936, 4096, 36, 32, 8, 12288, 1000000.0, 1e-6, MAX_POSITION, False, False,
                          head_dim=128, qk_norm=True),
}


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of this shape, by the loader's names."""
    hd = args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim), "norm.weight": (args.dim,)}
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    for layer in range(args.n_layers):
        p = f"layers.{layer}"
        shapes |= {
            f"{p}.attention_norm.weight": (args.dim,), f"{p}.ffn_norm.weight": (args.dim,),
            f"{p}.attention.wq.weight": (args.n_heads * hd, args.dim),
            f"{p}.attention.wk.weight": (args.n_kv_heads * hd, args.dim),
            f"{p}.attention.wv.weight": (args.n_kv_heads * hd, args.dim),
            f"{p}.attention.wo.weight": (args.dim, args.n_heads * hd),
            f"{p}.feed_forward.w1.weight": (args.ffn_dim, args.dim),
            f"{p}.feed_forward.w3.weight": (args.ffn_dim, args.dim),
            f"{p}.feed_forward.w2.weight": (args.dim, args.ffn_dim),
        }
        if args.qk_norm:
            shapes |= {f"{p}.attention.q_norm.weight": (hd,), f"{p}.attention.k_norm.weight": (hd,)}
        if args.qkv_bias:
            shapes |= {f"{p}.attention.w{n}.bias": (shape[0],) for n, shape in
                       (("q", shapes[f"{p}.attention.wq.weight"]), ("k", shapes[f"{p}.attention.wk.weight"]),
                        ("v", shapes[f"{p}.attention.wv.weight"]))}
    return shapes


class RandomTensors(Mapping):
    """A checkpoint's tensors, each made when it is read (seeded by its name, so a name always
    gives the same values) and not kept: the model holds only its quantized copies. Norm weights
    are ones, biases and other weights N(0, 0.02)."""

    def __init__(self, args: ModelArgs, device, seed: int = 0):
        self.shapes = tensor_shapes(args)
        self.device, self.seed = torch.device(device), seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device)
        generator = torch.Generator(self.device).manual_seed(self.seed + sum(map(ord, name)) * 7919 + len(name))
        return torch.randn(shape, generator=generator, device=self.device) * 0.02

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_checkpoint(name: str, device) -> Checkpoint:
    """The shape `name` (a key of SHAPES) with random weights made on `device`."""
    args = SHAPES[name]
    return Checkpoint(args, RandomTensors(args, device), f"random {name}", tokenizer=None)


def weight_bytes(model) -> int:
    """Bytes of the int8 weights a step reads (the embedding is a lookup of the step's rows)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "weight_chunks" in n and p.dtype == torch.int8)


def kv_bytes_read(args: ModelArgs, positions: int, element_size: int = 2) -> int:
    """Bytes of keys and values one row reads at `positions` cached positions, every layer."""
    return positions * args.n_layers * 2 * args.n_kv_heads * args.head_dim * element_size
