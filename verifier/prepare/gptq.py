"""GPTQ: choosing int8 weights that keep each layer's output, not each weight, close to float.

Rounding every weight to its nearest int8 value (quant.quantize_weight) minimizes the error of
each weight on its own. What matters is the layer's output on real inputs, ||W X - Q X||. GPTQ
(Frantar et al. 2022, after Optimal Brain Quantization) quantizes the input columns of W one at a
time and moves each column's rounding error onto the columns not yet quantized, in the direction
that the inputs' second moments H = X^T X say will cancel it best:

    err_j = (w_j - q_j) / U_jj;   w_k -= err_j * U_jk  for k > j,

where U is the upper Cholesky factor of H^-1 (U^T U = H^-1). This module uses that update in
closed form, which needs no inverse (see _feedback_matrix). Columns go in blocks of 16: inside a
block the feedback is applied row by row, to the rest of the matrix by one GEMM per block; all 30
layers of a kind are quantized as one batch, so the Python loop over columns runs once per kind.
Checked against the textbook column loop in tests/test_quant.py.

The scales stay per output channel (max |w| / 127 of the float row), so the result is what
quant.py already runs: int8 values and per-channel scales, the same kernels, the same exactness.
H is of the inputs each linear layer really reads in the rotated and smoothed float model, over
smoothing.py's calibration text (precondition.py); q/k/v share one H, gate/up another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pardec.verifier.model.quant import INT8_MAX
from pardec.verifier.prepare.workers import ONE, Workers

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs

# H += DAMPING * mean(diag H) * I: calibration has fewer tokens than some layers have inputs (H is
# then singular), and damping keeps the updates from overfitting those few tokens.
DAMPING = 0.01
BLOCK = 16
ROW_CHUNK = 4096


def _feedback_matrix(hessian: torch.Tensor) -> torch.Tensor:
    """A [..., in, in], fp32, upper triangular with unit diagonal: quantizing input column j after
    columns i < j with errors d_i = w_i - q_i, the weight to round is w_j + sum_i d_i A_ij.

    That is GPTQ's update in closed form. With H = V V^T, V upper triangular (a Cholesky factor of
    H with rows and columns reversed), V = U^-1 for the U above, so E = D V and, per column,
    w~_j = w_j + sum_{i<j} d_i V_ij / V_jj: one Cholesky, no inverse of H."""
    hessian = hessian.float()  # fp32, as GPTQ is usually run; damping keeps H well conditioned
    diagonal = hessian.diagonal(dim1=-2, dim2=-1)
    # An input that was zero on every calibration token: any weight is as good, H_jj = 1 keeps H invertible.
    diagonal[diagonal == 0] = 1.0
    diagonal.add_(DAMPING * diagonal.mean(dim=-1, keepdim=True))
    upper = torch.linalg.cholesky(hessian.flip(-2, -1)).flip(-2, -1)
    return upper / upper.diagonal(dim1=-2, dim2=-1)[..., None, :]


def _gptq_transposed(weight_t: torch.Tensor, feedback: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GPTQ over the rows of ``weight_t`` [batch, in, out] (the weight transposed, so that an input
    column is a contiguous row; overwritten); returns the integer values, fp32 [batch, in, out]."""
    inputs = weight_t.shape[1]
    original = weight_t.clone()
    errors = torch.empty_like(weight_t)  # w - q * scale, row by row as the rows are quantized
    for start in range(0, inputs, BLOCK):
        end = min(start + BLOCK, inputs)
        target = weight_t[:, start:end]  # a view, already holding the feedback of earlier blocks
        for j in range(start, end):
            quantized = target[:, j - start].div(scale).round_().clamp_(-INT8_MAX, INT8_MAX)
            torch.addcmul(original[:, j], quantized, scale, value=-1, out=errors[:, j])
            # Rows still to quantize in this block take the feedback now, those after it in one GEMM.
            target[:, j - start + 1 :].addcmul_(feedback[:, j, j + 1 : end, None], errors[:, j, None])
        weight_t[:, end:].baddbmm_(feedback[:, start:end, end:].transpose(1, 2), errors[:, start:end])
    # Every entry of (w - errors) / scale is an integer up to fp32 rounding; round() recovers it.
    return original.sub_(errors).div_(scale[:, None]).round_()


@dataclass
class _Job:
    """One (batch of) weight(s) to quantize: fp32 [batch, out, in], its scales [batch, out], the
    feedback of its inputs [batch, in, in], and where its int8 values go [batch, out, in]."""

    weight: torch.Tensor
    scale: torch.Tensor
    feedback: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, hessian: torch.Tensor) -> "_Job":
        weight = weight.float()
        # Per output channel, a block of channels at a time (no |weight| copy of a vocabulary-sized head).
        scale = torch.cat([block.abs().amax(dim=-1) for block in weight.split(ROW_CHUNK, dim=1)], dim=1) / INT8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return cls(weight, scale, _feedback_matrix(hessian), torch.empty(weight.shape, dtype=torch.int8))

    def chunk(self, first: int) -> None:
        """Output channels [first, first + ROW_CHUNK): independent of every other channel."""
        rows = slice(first, first + ROW_CHUNK)
        chunk_t = self.weight[:, rows].transpose(1, 2).contiguous()
        self.values[:, rows] = _gptq_transposed(chunk_t, self.feedback, self.scale[:, rows]).transpose(1, 2).to(torch.int8)


def _quantized(weights_and_hessians: list[tuple[torch.Tensor, torch.Tensor]], workers: Workers) -> list[_Job]:
    """Each (weight [batch, out, in], hessian [batch, in, in]) GPTQ-quantized, the Cholesky
    factorizations and then the chunks of output channels (which keep a block of rows in cache:
    an LM head has tens of thousands) spread over ``workers``."""
    jobs = workers.map(lambda pair: _Job.of(*pair), weights_and_hessians)
    workers.map(lambda piece: piece[0].chunk(piece[1]),
                [(job, first) for job in jobs for first in range(0, job.weight.shape[1], ROW_CHUNK)])
    return jobs


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor,
                  workers: Workers = ONE) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [..., out, in] and fp32 per-output-channel scales [..., out] for float ``weight``
    [..., out, in] (optionally a batch of same-shaped layers), by GPTQ's error feedback under the
    input second moments ``hessian`` [..., in, in]."""
    batched = weight.dim() == 3
    weight, hessian = (weight, hessian) if batched else (weight[None], hessian[None])
    (job,) = _quantized([(weight, hessian)], workers)
    return (job.values, job.scale) if batched else (job.values[0], job.scale[0])


def quantize_tensors(args: "ModelArgs", tensors: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor],
                     layers: list[int] | None = None, head: bool = True,
                     workers: Workers = ONE) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` whose linear weights (of decoder `layers`, all by default, and with
    `head` the LM head) are GPTQ int8 with a "<layer>.weight_scale" next to each, the layout
    transformer.py takes from an int8 checkpoint. The head needs a separate "output.weight"
    (rotation.py gives it one). ``workers`` share the pieces (workers.py: the same bits)."""
    out = dict(tensors)
    # Weights that read one input (transformer.py's fused modules), quantized together for all the
    # layers at once: a batch of 30 layers costs the Python loop over columns once instead of 30 times.
    kinds = {"attention.wqkv": ["attention.wq", "attention.wk", "attention.wv"], "attention.wo": ["attention.wo"],
             "feed_forward.w13": ["feed_forward.w1", "feed_forward.w3"], "feed_forward.w2": ["feed_forward.w2"]}
    prefixes = [f"layers.{layer}" for layer in (range(args.n_layers) if layers is None else layers)]
    kinds = list(kinds.items()) if prefixes else []
    # As many kinds at once as there are workers: each holds its float weights and factorization.
    for first in range(0, len(kinds), workers.count):
        group = kinds[first:first + workers.count]
        pairs = [(torch.stack([torch.cat([tensors[f"{p}.{name}.weight"] for name in names]) for p in prefixes]),
                  torch.stack([hessians[f"{p}.{reader}"] for p in prefixes])) for reader, names in group]
        for job, (_, names) in zip(_quantized(pairs, workers), group):
            sizes = [tensors[f"{prefixes[0]}.{name}.weight"].shape[0] for name in names]
            for p, layer_values, layer_scale in zip(prefixes, job.values, job.scale):
                for name, part_values, part_scale in zip(names, layer_values.split(sizes), layer_scale.split(sizes)):
                    # Copies of their own: views would keep the batch's storage and be copied again to be saved.
                    out[f"{p}.{name}.weight"], out[f"{p}.{name}.weight_scale"] = part_values.clone(), part_scale.clone()
        del pairs
    if head:
        (job,) = _quantized([(tensors["output.weight"][None], hessians["output"][None])], workers)
        out["output.weight"], out["output.weight_scale"] = job.values[0], job.scale[0]
    return out
