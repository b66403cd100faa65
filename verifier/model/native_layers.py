"""Every decoder layer of a CPU forward in one C call each (decoder_layer.c).

Used when every part of a layer is a CPU kernel: W8A8 linear layers on the native kernel, the fp32
attention kernel, sessions in a KVPool of the kernel's dtype (the engine's case). It computes the modules' bits exactly
(tests/test_native_layers.py), so the two paths are interchangeable; it only leaves out the ~35
torch ops a layer costs in Python, which were half of a 1-token step.

The C structs below mirror decoder_layer.c's field for field. The weights are read in place:
their pointers are taken at first use, so the model must not move to another device after it.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from pardec.verifier.model.quant import W8A8Linear

if TYPE_CHECKING:
    from pardec.verifier.kernels.native_attention import NativeAttention
    from pardec.verifier.kernels.native_linear import NativeLinear
    from pardec.verifier.model.step import StepPlan

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _W8A8Layer(ctypes.Structure):
    _fields_ = [("packed", _P), ("correction", _P), ("weight_scale", _P), ("bias", _P),
                ("in_features", _I64), ("in_padded", _I64), ("out_features", _I64), ("hadamard", _I64)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("attention_norm", _P), ("ffn_norm", _P),
                ("qkv", _W8A8Layer), ("o", _W8A8Layer), ("gate_up", _W8A8Layer), ("down", _W8A8Layer),
                ("q_norm", _P), ("k_norm", _P)]


class _ModelShape(ctypes.Structure):
    _fields_ = [("dim", _I64), ("n_heads", _I64), ("n_kv_heads", _I64), ("head_dim", _I64), ("ffn_dim", _I64),
                ("norm_eps", ctypes.c_float), ("attention_scale", ctypes.c_float)]


class _StepRows(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _P), ("signed_sin", _P), ("positions", _P), ("store_slots", _P),
                ("pool", _P), ("pool_slots", _I64), ("kv_bf16", _I64), ("attention", _P), ("n_segments", _I64),
                ("seg_start", _P), ("seg_steps", _P), ("seg_row", _P), ("seg_slot", _P), ("slots", _P),
                ("anc_ptr", _P), ("anc_idx", _P),
                ("normed", _P), ("qkv", _P), ("queries", _P), ("attended", _P), ("linear_out", _P),
                ("gate_up", _P), ("act", _P), ("row_scales", _P), ("quantized", _P), ("threads", ctypes.c_int)]


def _w8a8(layer: W8A8Linear) -> _W8A8Layer:
    if layer.native is None:
        raise ValueError("fused layers need every linear layer on the native W8A8 kernel")
    return _W8A8Layer(layer.packed.data_ptr(), layer.correction.data_ptr(), layer.weight_scale.data_ptr(),
                      None if layer.bias is None else layer.bias.data_ptr(), layer.in_features,
                      layer.packed.shape[1] * 4, layer.out_features, layer.input_hadamard)


class FusedLayers:
    def __init__(self, model: torch.nn.Module, kernels: "NativeLinear", attention: "NativeAttention"):
        """model: the Transformer (transformer.py) that builds this as one of its forward paths."""
        self._model, self._attention = model, attention
        self._fn = kernels.decoder_layer
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, ctypes.POINTER(_ModelShape), ctypes.POINTER(_LayerWeights),
                             ctypes.POINTER(_StepRows), _I64]
        args = model.args
        self._shape = _ModelShape(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_dim,
                                  args.norm_eps, args.head_dim ** -0.5)
        self._layers: list[_LayerWeights] | None = None  # at first use, once the weights are in place

    def can_run(self, plan: "StepPlan") -> bool:
        return plan.pool is not None and plan.native is not None

    def _weights(self) -> list[_LayerWeights]:
        if self._layers is None:
            self._layers = [
                _LayerWeights(block.attention_norm.weight.data_ptr(), block.ffn_norm.weight.data_ptr(),
                              _w8a8(block.attention.wqkv), _w8a8(block.attention.wo),
                              _w8a8(block.feed_forward.w13), _w8a8(block.feed_forward.w2),
                              *(None if norm is None else norm.weight.data_ptr()
                                for norm in (block.attention.q_norm, block.attention.k_norm)))
                for block in self._model.layers
            ]
        return self._layers

    @torch.no_grad()
    def run(self, h: torch.Tensor, positions: torch.Tensor, plan: "StepPlan") -> torch.Tensor:
        """h [rows, dim] fp32 embeddings -> the last layer's output; stores every layer's keys and values."""
        args, model, layout, pool = self._model.args, self._model, plan.layout, plan.pool
        rows, dim, ffn = h.shape[0], args.dim, args.ffn_dim
        h = h.contiguous()
        qkv_width = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        q_width = args.n_heads * args.head_dim  # Qwen3's is not dim
        widths = [dim, qkv_width, q_width, q_width, dim, 2 * ffn, ffn, 1]
        workspace = torch.empty(rows * sum(widths), dtype=torch.float32)
        parts, offset = [], 0
        for width in widths:
            parts.append(workspace.data_ptr() + offset * 4)
            offset += rows * width
        first = self._weights()[0]
        widest_input = max(part.in_padded for part in (first.qkv, first.o, first.gate_up, first.down))
        quantized = torch.empty(rows * widest_input, dtype=torch.uint8)
        positions = positions.to(torch.int64).contiguous()
        if positions.numel() and int(positions.max()) >= model.rope_cos.shape[0]:  # C reads the tables unchecked
            raise ValueError(f"position {int(positions.max())} is past the {model.rope_cos.shape[0]} served")
        store_slots = plan.pool_slots.to(torch.int64).contiguous()
        step = _StepRows(
            rows, model.rope_cos.data_ptr(), model.rope_signed_sin.data_ptr(), positions.data_ptr(),
            store_slots.data_ptr(), pool.kv.data_ptr(), pool.kv.shape[3], int(pool.kv.dtype == torch.bfloat16),
            self._attention.address,
            layout.starts.numel(), layout.starts.data_ptr(), layout.steps.data_ptr(), layout.first_rows.data_ptr(),
            layout.slot_offsets.data_ptr(), layout.slots.data_ptr(), layout.ancestor_offsets.data_ptr(),
            layout.ancestor_columns.data_ptr(), *parts, quantized.data_ptr(), torch.get_num_threads(),
        )
        shape, step_ref = ctypes.byref(self._shape), ctypes.byref(step)
        for index, weights in enumerate(self._weights()):
            status = self._fn(h.data_ptr(), shape, ctypes.byref(weights), step_ref, index)
            if status == 2:
                raise MemoryError("decoder_layer: out of memory for its scratch buffers")
            if status != 0:
                raise RuntimeError(f"decoder_layer failed at layer {index} with status {status}")
        return h
