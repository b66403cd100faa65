"""Everything specific to Ascend NPUs, in one place: the cards served, torch-npu's ops the verifier
calls, and the startup checks that refuse a device they do not hold for.

The NPU path is transformer.py's modules with three substitutions:

  * the W8A8 product is `torch_npu.npu_quant_matmul(x1, x2, scale, output_dtype=torch.int32)`:
    raw int32 sums, exact whatever blocking the card uses. That output exists on Atlas A2 (Ascend
    910B) and Atlas A3 (Ascend 910C) and takes no per-token scale, so the row's and the channel's
    scales are applied after it, in fp32, in the order quant.W8A8Linear applies them on CPU;
  * activations are quantized per row (token) by `torch_npu.npu_dynamic_quant(x)`: int8
    round(x / scale) with scale = max|x| / 127, from the row alone;
  * attention, norms and SwiGLU are fixed_order.py's fp32 torch ops: an Ascend NPU has no fp64, in
    which attention.py hides summation-order noise, so every reduction has an order fixed by its
    own row instead.

A host without torch-npu, a torch-npu without one of the ops, an unsupported card, a product that
is not exact, or elementwise ops that are not batch invariant is one ConfigError at startup, naming
the device and what to do. Should npu_dynamic_quant refuse fp32 rows or disagree with its documented
arithmetic, the rows are quantized by quant.quantize_activation's torch ops instead (as batch
invariant; a warning says so).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from pardec.runtime.errors import ConfigError
from pardec.verifier.model import fixed_order
from pardec.verifier.model.quant import int8_matmul_is_exact, quantize_activation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CardFamily:
    prefix: str  # of torch.npu.get_device_name()
    family: str


# Cards whose npu_quant_matmul returns int32 sums and which have npu_dynamic_quant.
SUPPORTED_CARDS = (
    CardFamily("Ascend910B", "Atlas A2 (Ascend 910B: Atlas 800I A2, 800T A2)"),
    CardFamily("Ascend910_93", "Atlas A3 (Ascend 910C)"),
)
# torch_npu's functions the NPU path calls, and what for.
REQUIRED_OPS = {
    "npu_quant_matmul": "the int8 product with int32 output",
    "npu_dynamic_quant": "per-row int8 quantization of activations",
}
FP32_TINY = torch.finfo(torch.float32).tiny


def card_family(name: str) -> str | None:
    """The supported family of a card by its device name, None when it is not one.

    >>> card_family("Ascend910B3"), card_family("Ascend910_9391"), card_family("Ascend310P3")
    ('Atlas A2 (Ascend 910B: Atlas 800I A2, 800T A2)', 'Atlas A3 (Ascend 910C)', None)
    """
    return next((card.family for card in SUPPORTED_CARDS if name.startswith(card.prefix)), None)


def import_torch_npu(spec: str):
    """torch_npu, which registers torch.npu and the "npu" device type; a ConfigError without it."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as error:
        raise ConfigError(
            f"device {spec!r}: torch-npu is not installed ({error}); install the torch-npu release "
            f"matching torch {torch.__version__} and the Ascend CANN toolkit"
        ) from error


def check_ops(spec: str, torch_npu) -> None:
    """A ConfigError naming the first of REQUIRED_OPS this torch-npu lacks."""
    for op, purpose in REQUIRED_OPS.items():
        if not hasattr(torch_npu, op):
            version = getattr(torch_npu, "__version__", "of unknown version")
            raise ConfigError(
                f"device {spec!r}: torch-npu {version} has no torch_npu.{op} ({purpose}); the verifier "
                f"needs a torch-npu and CANN release for Atlas A2/A3 that provides {', '.join(REQUIRED_OPS)}"
            )


def check_device(spec: str, index: int) -> None:
    """Startup checks of NPU `index` (spec as the user wrote it): torch-npu and its ops, an NPU
    there, and a supported card. Each failure is a ConfigError naming the device and the remedy."""
    torch_npu = import_torch_npu(spec)
    check_ops(spec, torch_npu)
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise ConfigError(f"device {spec!r}: torch-npu found no Ascend NPU (check the driver and npu-smi)")
    count = npu.device_count()
    if index >= count:
        raise ConfigError(f"device {spec!r}: only {count} npu device(s) here, numbered from 0")
    name = npu.get_device_name(index)
    if card_family(name) is None:
        supported = "; ".join(f"{card.family}: {card.prefix}*" for card in SUPPORTED_CARDS)
        raise ConfigError(
            f"device {spec!r} is an {name!r}, which the verifier does not serve: it needs a card whose "
            f"npu_quant_matmul returns exact int32 sums ({supported}); serve on one of those or with --device cpu"
        )


@dataclass(frozen=True)
class AscendOps:
    """torch-npu's ops as the NPU path calls them. quantizes_rows_on_npu: npu_dynamic_quant
    quantizes the rows (else quant.quantize_activation's torch ops, which startup_ops chooses
    when the op is unfit for fp32 rows)."""

    torch_npu: Any
    quantizes_rows_on_npu: bool = True

    def int8_matmul(self, x_int8: torch.Tensor, weight: torch.Tensor,
                    neutral_scale: torch.Tensor | None = None) -> torch.Tensor:
        """int8 [T, K] x int8 [K, N] -> int32 [T, N], the exact sums. `scale` is a required
        argument of npu_quant_matmul; ones keep it neutral should the card apply it."""
        if neutral_scale is None:
            neutral_scale = torch.ones(weight.shape[1], dtype=torch.float32, device=weight.device)
        return self.torch_npu.npu_quant_matmul(x_int8, weight, neutral_scale, output_dtype=torch.int32)

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 rows [T, K] -> (int8 [T, K], fp32 scale [T, 1]), each row from itself alone. The
        scale's floor keeps an all-zero row's dequantization finite, as quantize_activation's."""
        if not self.quantizes_rows_on_npu:
            values, scale = quantize_activation(x)
            return values.to(torch.int8), scale
        values, scale = self.torch_npu.npu_dynamic_quant(x)
        return values, scale.float().view(-1, 1).clamp_min(FP32_TINY)


def dynamic_quant_fits(ops: AscendOps, device: torch.device | str) -> bool:
    """True when npu_dynamic_quant takes fp32 rows on `device`, gives each row the same bits alone
    as in a batch, and computes its documented arithmetic (scale = max|x| / 127, values within
    rounding of x / scale)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(17, 576, generator=generator) * 4
    x[3] *= 1e-3  # a row of another magnitude
    on_device = x.to(device)
    try:
        values, scale = ops.torch_npu.npu_dynamic_quant(on_device)
        alone = [ops.torch_npu.npu_dynamic_quant(on_device[i : i + 1]) for i in range(x.shape[0])]
    except (RuntimeError, TypeError, ValueError) as error:
        log.warning("npu_dynamic_quant refused fp32 rows on %s (%s): rows are quantized by torch ops", device, error)
        return False
    values, scale = values.cpu(), scale.float().cpu().view(-1)
    invariant = all(torch.equal(values[i : i + 1], row.cpu()) and torch.equal(scale[i : i + 1], row_scale.float().cpu().view(-1))
                    for i, (row, row_scale) in enumerate(alone))
    documented = (values.dtype == torch.int8
                  and torch.allclose(scale, x.abs().amax(dim=-1) / 127, rtol=1e-6, atol=0)
                  and bool(((values.float() - x / scale[:, None]).abs() <= 0.5 + 1e-3).all()))
    if not (invariant and documented):
        log.warning("npu_dynamic_quant on %s is %s: rows are quantized by torch ops", device,
                    "not batch invariant" if not invariant else "not the documented arithmetic")
        return False
    return True


def startup_ops(device: torch.device | str) -> AscendOps:
    """The Ascend ops for `device`, after probing them there: the int8 product exact, the
    fixed-order ops batch invariant (a ConfigError otherwise), and npu_dynamic_quant fit for fp32
    rows (else the torch quantization)."""
    spec = str(device)
    torch_npu = import_torch_npu(spec)
    check_ops(spec, torch_npu)
    ops = AscendOps(torch_npu)
    if not int8_matmul_is_exact(ops.int8_matmul, device, "npu_quant_matmul"):
        raise ConfigError(
            f"device {spec!r}: torch_npu.npu_quant_matmul with int32 output failed or was not exact on "
            "the startup probe (see the log); the verifier needs exact int8 sums (Atlas A2/A3, a "
            "current torch-npu and CANN); serve with --device cpu"
        )
    if not fixed_order.is_batch_invariant(device):
        raise ConfigError(
            f"device {spec!r}: the fp32 fixed-order ops (norm, SwiGLU, attention) gave a row other bits "
            "alone than in a batch here, so tree verification would not be lossless; serve with --device cpu"
        )
    on_npu = dynamic_quant_fits(ops, device)
    log.info("Ascend ops on %s: npu_quant_matmul (int32), rows quantized by %s", device,
             "npu_dynamic_quant" if on_npu else "torch ops")
    return replace(ops, quantizes_rows_on_npu=on_npu)
