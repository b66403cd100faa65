"""Preparing float weights for W8A8 at load: rotate, smooth, then choose int8 weights by GPTQ.

All three steps are calibrated by one float forward of the rotated model over smoothing.py's
built-in text, which records, for the input of every linear layer, max |x_j| (for smoothing) and
X^T X (for GPTQ). Smoothing divides a layer's input channel j by s_j, so the Hessian of the
smoothed inputs is H_jk / (s_j s_k): no second forward is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pardec.verifier.prepare.gptq import quantize_tensors
from pardec.verifier.prepare.rotation import rotate
from pardec.verifier.prepare.smoothing import calibration_token_lists, run_calibration, smooth, smoothing_factors

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs
    from pardec.verifier.model.transformer import Transformer
    from pardec.verifier.model.tokenizer import ChatTokenizer


def input_statistics(float_model: "Transformer", token_lists: list[list[int]],
                     with_hessians: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """max |x_j| [in] and, with_hessians, X^T X [in, in] (fp32; ~400 MB for SmolLM2-135M, held
    while it loads) of the inputs of every linear layer over the calibration tokens, by module
    name ("layers.0.attention.wqkv", ..., "output")."""
    maxima: dict[str, torch.Tensor] = {}
    hessians: dict[str, torch.Tensor] = {}

    def record(name, x):
        x = x.float().cpu()
        row_max = x.abs().amax(dim=0)
        maxima[name] = row_max if name not in maxima else torch.maximum(maxima[name], row_max)
        if with_hessians:
            product = x.T @ x
            hessians[name] = product if name not in hessians else hessians[name].add_(product)

    run_calibration(float_model, token_lists, record)
    return maxima, hessians


def precondition(args: "ModelArgs", tensors: dict[str, torch.Tensor], tokenizer: "ChatTokenizer",
                 float_model: Callable[[dict[str, torch.Tensor]], "Transformer"], gptq: bool = True,
                 ) -> dict[str, torch.Tensor]:
    """Rotated and smoothed copy of float ``tensors``; with gptq, its linear weights are int8 with
    a "<layer>.weight_scale" each (the int8 checkpoint layout). float_model builds a float
    Transformer from tensors."""
    rotated = rotate(args, tensors)
    maxima, hessians = input_statistics(float_model(rotated), calibration_token_lists(tokenizer), gptq)
    factors = smoothing_factors(args, rotated, maxima)
    smoothed = smooth(args, rotated, factors)
    if not gptq:
        return smoothed
    for name, s in factors.items():
        hessians[name] = hessians[name] / torch.outer(s, s)
    return quantize_tensors(args, smoothed, hessians)
