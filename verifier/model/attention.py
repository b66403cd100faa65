"""Tree attention of one session's step rows over its cached prefix, in float64: the path off the
CPU and on hosts without a C compiler (on CPU the fp32 kernel of native_attention.py runs).

Attention's reductions block differently for every query count and key count. In fp64 that
rounding noise is ~1e-16 relative and practically never reaches an int8 rounding boundary of
o_proj's activation quantizer (quant.quantize_activation reads the fp64 output directly); fp32
noise (~1e-7) would, now and then. So a row's output does not depend on how many other rows or
sessions share the step, nor on where a query block ends -- which is what lets the engine batch
sessions and cut prompts into chunks freely. Masked keys get -inf and contribute exact zeros.

The kernel is torch's scaled_dot_product_attention (a fused CPU kernel, fp64 supported, GQA
built in). Measured faster than bmm + softmax + bmm for one query, for a tree of queries and for
a prompt chunk alike (docs/benchmarks.md, "Figures behind design choices"); outputs differ by
~1e-16, and the bit-identity tests hold. fp32 would be 2-3x faster (memory and SIMD width),
which is why the precision is the price of batch invariance here; see bench/verifier_steps.py
for what that price is per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Query rows per attention call. Row t of a step only sees keys [0, start + t], so a block of
# rows [a, b) needs keys [0, start + b) only: for a prompt chunk this skips most of the upper
# triangle of the mask, at the cost of one more call per block.
QUERY_BLOCK = 128


def step_mask(ancestors: torch.Tensor, start: int) -> torch.Tensor | None:
    """Additive fp64 mask [T, start + T]: 0 where row t may attend (the committed prefix, its
    ancestors in the step and itself), -inf elsewhere; None when every row sees every key (a
    one-token step). Built once per step and shared by all layers."""
    steps = ancestors.shape[0]
    if bool(ancestors.all()):
        return None
    mask = torch.zeros(steps, start + steps, dtype=torch.float64, device=ancestors.device)
    mask[:, start:].masked_fill_(~ancestors, float("-inf"))
    return mask


def attend(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, start: int
) -> torch.Tensor:
    """queries [1, n_heads, T, head_dim] fp64 (rotated); keys, values [1, n_kv_heads, start + T,
    head_dim] fp64 (exact copies of the cached fp32 values); mask from step_mask (rows only see
    earlier step columns: ancestors is lower-triangular) -> fp64 [1, n_heads, T, head_dim].

    Head h uses kv head h // (n_heads / n_kv_heads), as transformers' repeat_kv does. 4-D
    because the fused CPU kernel takes only 4-D inputs (3-D falls back to the unfused math path).
    """
    steps = queries.shape[2]
    if steps <= QUERY_BLOCK:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
    parts = []
    for a in range(0, steps, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, steps)
        end = start + b
        parts.append(F.scaled_dot_product_attention(
            queries[:, :, a:b], keys[:, :, :end], values[:, :, :end], attn_mask=mask[a:b, :end], enable_gqa=True
        ))
    return torch.cat(parts, dim=2)
