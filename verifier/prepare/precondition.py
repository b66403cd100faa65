"""Preparing float weights for W8A8 at load: rotate, smooth, then choose int8 weights by GPTQ.

All three steps are calibrated by one float forward of the rotated model over smoothing.py's
built-in text, which records, for the input of every linear layer, max |x_j| (for smoothing) and
X^T X (for GPTQ). Smoothing divides a layer's input channel j by s_j, so the Hessian of the
smoothed inputs is H_jk / (s_j s_k): no second forward is needed.

Every step is local to a decoder layer: a layer's rotation needs only its own weights and the
fixed rotation matrices, its statistics only its inputs, which are the previous layer's float
outputs on the calibration text, and its smoothing and GPTQ only its weights and statistics. So
`precondition` streams: it reads one layer's float tensors, rotates them, runs that layer alone
over the calibration activations (recording its statistics and the next layer's inputs),
smooths it, quantizes it to int8 and lets its float copies go before reading the next. Host
memory holds the int8 model, the embedding table, one layer in float with its statistics and the
calibration activations, never the float model; and each layer runs the very module code, on
the very rows, that a forward of the whole float model would.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from pardec.runtime.memory import release_freed_memory
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.step import StepInput, StepPlan
from pardec.verifier.model.rotary import rotary_tables
from pardec.verifier.model.transformer import FloatLinear, RMSNorm, TransformerBlock
from pardec.verifier.prepare.gptq import quantize_tensors
from pardec.verifier.prepare.rotation import rotate_embedding, rotate_head, rotate_layer, rotations
from pardec.verifier.prepare.workers import ONE, Workers
from pardec.verifier.prepare.smoothing import (
    calibration_token_lists, head_smoothing_factors, layer_smoothing_factors, recording_inputs, smooth_head,
    smooth_layer,
)

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs
    from pardec.verifier.model.tokenizer import ChatTokenizer


# The most bytes of X^T X products the calibration's texts hold at once while their forwards run
# side by side (LayerwiseCalibration.run_layer).
HESSIAN_BYTES = 2 << 30


class Statistics:
    """max |x_j| [in] and, with hessians, X^T X [in, in] (fp32) of recorded input rows, by name."""

    def __init__(self, with_hessians: bool):
        self.with_hessians = with_hessians
        self.maxima: dict[str, torch.Tensor] = {}
        self.hessians: dict[str, torch.Tensor] = {}

    def record(self, name: str, x: torch.Tensor) -> None:
        x = x.float().cpu()
        row_max = x.abs().amax(dim=0)
        self.maxima[name] = row_max if name not in self.maxima else torch.maximum(self.maxima[name], row_max)
        if self.with_hessians:
            product = x.T @ x
            self.hessians[name] = product if name not in self.hessians else self.hessians[name].add_(product)

    def add(self, other: "Statistics") -> None:
        """``other``'s records after this one's: with one record per name in ``other`` (one
        text's forward), the same sums as recording them here in that order."""
        for name, row_max in other.maxima.items():
            self.maxima[name] = row_max if name not in self.maxima else torch.maximum(self.maxima[name], row_max)
        for name, product in other.hessians.items():
            self.hessians[name] = product if name not in self.hessians else self.hessians[name].add_(product)


class LayerwiseCalibration:
    """The rotated float model's forward over the calibration texts, one decoder layer at a time:
    `run_layer` takes layer i's float tensors and moves every text's rows from layer i's input
    to its output, recording the inputs of its linear layers; `final_rows` are the last layer's
    outputs after the final norm, what the LM head reads."""

    def __init__(self, args: "ModelArgs", embedding: torch.Tensor, token_lists: list[list[int]],
                 rope_freqs: torch.Tensor | None):
        self.args = args
        # Tables for the longest text only (a YaRN model's full ones are a hundred MiB or more); a
        # position's entries are the same numbers at any table length.
        longest = min(args.max_position, max([1, *map(len, token_lists)]))
        cos, signed_sin = rotary_tables(dataclasses.replace(args, max_position=longest), rope_freqs)
        self.texts = []
        for tokens in token_lists:
            tokens = torch.tensor(tokens[: args.max_position])
            count = tokens.numel()
            cache = KVCache(args, count)
            cache.reserve(count)
            positions = torch.arange(count)
            # One plan per text for every layer: each layer writes and reads its own cache rows.
            plan = StepPlan.build([StepInput(tokens, positions, torch.ones(count, count, dtype=torch.bool).tril(), cache)])
            self.texts.append([embedding[tokens], cos[positions][:, None], signed_sin[positions][:, None], plan])

    @torch.no_grad()
    def run_layer(self, layer: int, tensors: Mapping[str, torch.Tensor], statistics: Statistics,
                  workers: Workers = ONE) -> None:
        """Each text's forward on a worker, its records kept apart and added to ``statistics`` in
        the texts' order: the sums of one forward after another. A wave of texts at a time, as
        many as their X^T X products fit HESSIAN_BYTES beside the running sums (a 7B model's
        down_proj alone is 0.8 GB); with one worker, each product added as it is made."""
        block = TransformerBlock(self.args, tensors, layer, FloatLinear)
        current = threading.local()  # the statistics of the text this thread runs

        def run(text: list) -> None:  # the text's rows through the layer, in their place
            rows, cos, signed_sin, plan = text
            text[0] = block(rows, cos, signed_sin, layer, plan)

        def forward(text: list) -> Statistics:
            current.statistics = Statistics(statistics.with_hessians)
            run(text)
            return current.statistics

        prefix = f"layers.{layer}."
        if workers.count == 1:  # one text after another, each product added as it is made
            with recording_inputs(block, statistics.record, prefix=prefix):
                for text in self.texts:
                    run(text)
            return
        args = self.args
        per_text = 4 * (2 * args.dim ** 2 + args.q_dim ** 2 + args.ffn_dim ** 2) if statistics.with_hessians else 0
        # The running sums are one text's worth more.
        wave = max(1, min(workers.count, HESSIAN_BYTES // max(1, per_text) - 1))
        with recording_inputs(block, lambda name, x: current.statistics.record(name, x), prefix=prefix):
            for first in range(0, len(self.texts), wave):
                for recorded in workers.map(forward, self.texts[first:first + wave]):
                    statistics.add(recorded)

    def final_rows(self, norm_weight: torch.Tensor) -> list[torch.Tensor]:
        norm = RMSNorm(norm_weight, self.args.norm_eps)
        with torch.no_grad():
            return [norm(text[0]) for text in self.texts]


def layer_names(tensors: Mapping[str, torch.Tensor], layer: int) -> list[str]:
    prefix = f"layers.{layer}."
    return [name for name in tensors if name.startswith(prefix)]


def precondition(args: "ModelArgs", tensors: Mapping[str, torch.Tensor], tokenizer: "ChatTokenizer",
                 gptq: bool = True, workers: Workers = ONE) -> dict[str, torch.Tensor]:
    """Rotated and smoothed copy of float ``tensors`` (a dict, or a checkpoint's LazyTensors,
    read one layer at a time); with gptq, its linear weights are int8 with a
    "<layer>.weight_scale" each (the int8 checkpoint layout). ``workers`` share its independent
    pieces (rotated matrices, GPTQ chunks, calibration texts): the same bits with any number."""
    rotation, head_rotation = rotations(args)
    # The head is made at the end, when its statistics are known: a vocabulary-sized float
    # matrix not held while the layers stream.
    out = rotate_embedding(tensors, rotation, workers)
    if "rope_freqs" in tensors:
        out["rope_freqs"] = tensors["rope_freqs"]
    calibration = LayerwiseCalibration(args, out["tok_embeddings.weight"], calibration_token_lists(tokenizer),
                                       out.get("rope_freqs"))
    for layer in range(args.n_layers):
        rotated = {name: tensors[name] for name in layer_names(tensors, layer)}
        rotated.update(rotate_layer(args, rotated, layer, rotation, head_rotation, workers))
        statistics = Statistics(gptq)
        calibration.run_layer(layer, rotated, statistics, workers)
        factors = layer_smoothing_factors(args, rotated, statistics.maxima, layer)
        smooth_layer(args, rotated, factors, layer)
        if gptq:
            hessians = {name: statistics.hessians[name] / torch.outer(s, s) if (s := factors.get(name)) is not None
                        else hessian for name, hessian in statistics.hessians.items()}
            rotated = quantize_tensors(args, rotated, hessians, layers=[layer], head=False, workers=workers)
        out.update(rotated)
        del rotated, statistics
        release_freed_memory()  # this layer's float copies
    statistics = Statistics(gptq)
    for rows in calibration.final_rows(out["norm.weight"]):
        statistics.record("output", rows)
    del calibration
    out.update(rotate_head(tensors, rotation, workers))
    factors = head_smoothing_factors(out, statistics.maxima)
    smooth_head(out, factors, own_head=True)  # rotate_head made it
    if not gptq:
        return out
    hessian = statistics.hessians["output"]
    if "output" in factors:
        hessian = hessian / torch.outer(factors["output"], factors["output"])
    return quantize_tensors(args, out, {"output": hessian}, layers=[], head=True, workers=workers)
