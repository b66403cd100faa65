"""A checkpoint's tensors read when asked for, not before, and never kept.

A loader gives every tensor's name and shape up front (from a GGUF header or safetensors headers,
or a shape table for random models) and one function that makes a tensor from its name. Building
a model then reads one tensor at a time, quantizes it and drops the float copy, so a load never
holds the whole checkpoint in fp32; a start whose prepared weights come from the cache reads none
of it at all.

>>> import torch
>>> reads = []
>>> tensors = LazyTensors({"a": (2,), "b": (1, 3)}, lambda name: reads.append(name) or torch.zeros(tensors.shapes[name]))
>>> sorted(tensors), shape_of(tensors, "b"), reads
(['a', 'b'], (1, 3), [])
>>> tensors["b"].shape, reads
(torch.Size([1, 3]), ['b'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class LazyTensors(Mapping):
    """name -> tensor, made by `load(name)` at each read (a reader that wants one copy keeps it)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], load: Callable[[str], torch.Tensor]):
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self._load = load

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes


def shape_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape without reading it when `tensors` is lazy."""
    if isinstance(tensors, LazyTensors):
        return tensors.shapes[name]
    return tuple(tensors[name].shape)
