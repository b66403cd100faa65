"""One session's keys and values in tensors of its own: the contiguous cache of tests and tools.

It speaks the protocol kvcache.py describes, as the pool's PagedCache does, and stores fp32, so a
model whose pool stores fp32 (the CPU's default) computes the same logits on either; a model
serving a bf16 pool runs a KVCache on the fp64 path (tests and tools only; never in one forward
with its pool's sessions: step.py refuses the mix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs


class KVCache:
    """One session's keys and values: committed positions, then the last forward's step area."""

    def __init__(self, args: "ModelArgs", capacity: int, device="cpu"):
        if not 0 < capacity <= args.max_position:
            raise ValueError(f"capacity must be in [1, {args.max_position}], got {capacity}")
        self.max_position = args.max_position
        self.n_kv_heads = args.n_kv_heads
        shape = (args.n_layers, capacity, args.n_kv_heads, args.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.length = 0
        # Rows the last forward wrote at [length, length + step_size); commit may only pick from them.
        self.step_size = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def reserve(self, extra: int) -> None:
        needed = self.length + extra
        if needed <= self.capacity:
            return
        if needed > self.max_position:
            raise ValueError(f"sequence of {needed} positions exceeds the {self.max_position} served (the model's "
                             "context, or the verifier's max_seq_len)")
        # Doubling keeps the total copying linear in the final length.
        new_capacity = min(max(needed, 2 * self.capacity), self.max_position)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], new_capacity, *old.shape[2:]))
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def begin_step(self, steps: int) -> None:
        if self.length + steps > self.capacity:
            raise ValueError(f"cache holds {self.capacity} positions; reserve {steps} beyond {self.length} first")
        self.step_size = steps

    def store(self, layer: int, kv: torch.Tensor) -> None:
        # kv: [steps, 2 * n_kv_heads, head_dim], keys (rotated) then values.
        rows = slice(self.length, self.length + kv.shape[0])
        self.k[layer, rows] = kv[:, : self.n_kv_heads]
        self.v[layer, rows] = kv[:, self.n_kv_heads :]

    def load(self, layer: int, end: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :end].to(dtype).transpose(0, 1)[None], self.v[layer, :end].to(dtype).transpose(0, 1)[None]

    def commit(self, slots: torch.Tensor) -> None:
        count = slots.numel()
        if count and (int(slots.min()) < 0 or int(slots.max()) >= self.step_size):
            raise ValueError(f"commit slots must index the last step's {self.step_size} rows")
        source = self.length + slots.to(self.k.device)
        target = slice(self.length, self.length + count)
        # Advanced indexing gathers a copy before the write, so slots overlapping the target are safe.
        self.k[:, target] = self.k[:, source]
        self.v[:, target] = self.v[:, source]
        self.length += count
        self.step_size = 0
