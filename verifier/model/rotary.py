"""Rotary position embeddings: each position's cos and signed-sin tables, built once per model from
the checkpoint's theta and the scaling it states (args.RopeScaling), and their application to q
and k. Every forward path (the modules, the CPU's C layers, the device engine) reads the same
tables, so they rotate with the same bits; the float model matches transformers' arithmetic."""

import math

import torch

from pardec.verifier.model.args import ModelArgs, RopeScaling


def inverse_frequencies(args: ModelArgs, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary's fp32 inverse frequencies [head_dim / 2], in transformers' arithmetic, so the float
    model matches it: theta^(-2i/d), then the scaling the config states (args.RopeScaling), or a
    GGUF file's per-frequency divisors (llama.cpp's "rope_freqs" tensor: Llama 3.1's scaling as
    its converter computes it)."""
    inverse = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    if freq_factors is not None:
        return inverse / freq_factors.float()
    scaling = args.rope_scaling
    if scaling is None:
        return inverse
    if scaling.kind == "linear":
        return inverse / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inverse, args, scaling)
    wavelength = 2 * math.pi / inverse
    long_wave = scaling.original_max_position / scaling.low_freq_factor
    short_wave = scaling.original_max_position / scaling.high_freq_factor
    divided = torch.where(wavelength > long_wave, inverse / scaling.factor, inverse)
    # Between the two wavelengths, a linear blend of divided and kept by how many original
    # contexts a wavelength spans.
    blend = (scaling.original_max_position / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * divided / scaling.factor + blend * divided
    middle = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(middle, blended, divided)


def _yarn(inverse: torch.Tensor, args: ModelArgs, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies: dimension pair i keeps theta^(-2i/d) where it turns more than beta_fast
    times over the original context, is divided by `factor` where it turns fewer than beta_slow
    times, and blends the two linearly in i between."""
    d, base = args.head_dim, args.rope_theta

    def dimension(turns: float) -> float:  # where (in units of d) a frequency turns `turns` times
        return d * math.log(scaling.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    kept = 1 - ramp  # the share of the original frequency
    divided = 1.0 / (scaling.factor * args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return divided * (1 - kept) + inverse * kept


def rotary_tables(args: ModelArgs, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, [max_position, head_dim], for Hugging Face's rotate_half convention.

    rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * [-1.., +1..]; folding that sign into the sin table
    turns rotary into x * cos + roll(x) * sin, with the same values as transformers' formula.
    """
    angles = torch.outer(torch.arange(args.max_position, dtype=torch.float32), inverse_frequencies(args, freq_factors))
    cos, signed_sin = torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat([-angles.sin(), angles.sin()], dim=-1)
    scaling = args.rope_scaling
    if scaling is not None and scaling.kind == "yarn" and scaling.attention_factor != 1.0:
        return cos * scaling.attention_factor, signed_sin * scaling.attention_factor
    return cos, signed_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, signed_sin: [T, 1, head_dim]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
