"""The forward's reductions in fp32, each in an order fixed by its own row: for devices without
fp64 and without the CPU's C kernels -- the Ascend NPU (ascend.py) -- and on CPU as the same
path's mirror (`--attention fixed_order`).

A float reduction by a library kernel sums in an order the kernel picks by shape, so a row's
result can change with how many rows share the call; attention.py hides that noise in fp64,
which an Ascend NPU does not have. Here every sum is `pairwise_sum`: a balanced binary tree of
elementwise adds of neighbours, written as torch ops. An elementwise add rounds each element on
its own, so the tree gives the same bits on any device and for any batch -- what tree
verification needs (see quant.py). Two properties make it usable:

  * zeros after a row's values change nothing: the tree over n values padded with zeros to any
    power of two is the tree over the shortest power-of-two cover of n (the padding's subtrees
    sum to 0, and x + 0 = x);
  * an aligned block of 2**k neighbours is a subtree, so a sum cut into such blocks (to bound
    memory) and the blocks' sums then summed by the same tree is the same tree, bit for bit.

So attention walks a row's visible keys as one compact sequence -- the committed positions, then
its ancestors in the step, in order -- as triton_attention.py does: a tree node sees the very
sequence plain decoding of its path sees, padded only after its own keys, and gets the same bits
however many rows, sessions, key blocks or query groups the forward has. Softmax is two-pass
(the row's max, exact in any order; then the weights and their sums), so there is no running
rescale whose rounding would depend on where blocks end.

Elementwise functions must compute each element by one function wherever it sits in a tensor.
On CPU torch's sigmoid and silu do not (a vector body and a scalar tail round differently), exp,
rsqrt and division do; so SwiGLU here is gate / (1 + exp(-gate)) * up. `is_batch_invariant`
checks the whole set on the device at startup.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Keys per block of the attention loop, and the most fp32 products a block's query rows hold at
# once. Neither changes a bit (blocks are subtrees, query rows are independent): they bound memory.
KEY_BLOCK = 64
PRODUCT_BUDGET = 1 << 24


def pairwise_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` as a balanced tree of neighbour adds, the width zero-padded to a power of two.

    >>> pairwise_sum(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]))  # ((1 + 2) + (3 + 4)) + ((5 + 0) + (0 + 0))
    tensor([15.])
    """
    x = x.movedim(dim, -1)
    width = x.shape[-1]
    padded = 1 << max(width - 1, 0).bit_length()
    if padded != width:
        x = F.pad(x, (0, padded - width))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, dim] -> x / sqrt(mean(x^2) + eps) * weight, the mean by pairwise_sum."""
    mean = pairwise_sum(x * x) / x.shape[-1]
    return x * torch.rsqrt(mean + eps)[..., None] * weight


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * width] -> silu(gate) * up, silu as gate / (1 + exp(-gate)) (see above)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return gate / (torch.exp(-gate) + 1.0) * up


class FixedOrderOps:
    """The norm and SwiGLU of transformer.py's modules (the interface of native_linear's C ops)."""

    rms_norm = staticmethod(rms_norm)
    silu_mul = staticmethod(silu_mul)


@dataclass(frozen=True)
class VisibleKeys:
    """Each step row's keys as one compact sequence: committed positions 0..start-1, then the row's
    ancestors in the step (ascending, itself last). Built once per forward, read by every layer."""

    positions: torch.Tensor  # int64 [T, width]: the position of each rank; past the row's keys, its own
    valid: torch.Tensor  # bool [T, width]: rank < the row's count of visible keys

    @classmethod
    def build(cls, ancestors: torch.Tensor, start: int) -> "VisibleKeys":
        """ancestors bool [T, T] (row i sees step row j where True), start committed positions.

        >>> keys = VisibleKeys.build(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), 2)
        >>> keys.positions.tolist(), keys.valid.sum(1).tolist()
        ([[0, 1, 2, 2], [0, 1, 2, 3], [0, 1, 2, 4]], [3, 4, 4])
        """
        steps = ancestors.shape[0]
        device = ancestors.device
        columns = torch.arange(steps, device=device)
        counts = ancestors.sum(dim=1)
        width = start + int(counts.max())
        # Ancestor columns in ascending order, then `steps` as filler: a stable sort of the keys.
        ordered = torch.where(ancestors, columns, steps).sort(dim=1, stable=True).values[:, : width - start]
        ranks = torch.arange(width - start, device=device)
        valid_step = ranks < counts[:, None]
        step_positions = start + torch.where(valid_step, ordered, columns[:, None])
        prefix = torch.arange(start, device=device).expand(steps, start)
        positions = torch.cat([prefix, step_positions], dim=1)
        valid = torch.cat([torch.ones(steps, start, dtype=torch.bool, device=device), valid_step], dim=1)
        return cls(positions, valid)

    def rows(self, first: int, end: int) -> "VisibleKeys":
        """Rows [first, end), cut to the widest of their sequences."""
        valid = self.valid[first:end]
        width = int(valid.sum(dim=1).max())
        return VisibleKeys(self.positions[first:end, :width], valid[:, :width])


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: VisibleKeys,
           key_block: int = KEY_BLOCK) -> torch.Tensor:
    """Softmax attention of one session's step rows in fp32, every sum a pairwise_sum over the row's
    own key sequence. queries [T, H, HD] (rotated); keys, values [KV, positions, HD] (the step's
    rows stored); head h reads kv head h // (H / KV) -> [T, H * HD]."""
    steps, heads, head_dim = queries.shape
    group = heads // keys.shape[0]
    rows_at_once = max(1, PRODUCT_BUDGET // (heads * key_block * head_dim))
    parts = [_attend_rows(queries[first : first + rows_at_once], keys, values,
                          visible.rows(first, min(first + rows_at_once, steps)), group, key_block)
             for first in range(0, steps, rows_at_once)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(steps, heads * head_dim)


def _attend_rows(queries, keys, values, visible: VisibleKeys, group: int, key_block: int) -> torch.Tensor:
    rows, heads, head_dim = queries.shape
    kv_heads = keys.shape[0]
    q = (queries * head_dim ** -0.5).view(rows, kv_heads, group, 1, head_dim)
    width = visible.positions.shape[1]
    blocks = range(0, width, key_block)

    def gathered(storage: torch.Tensor, first: int) -> torch.Tensor:
        # [rows, KV, 1, block, HD]: each row's keys (or values) of ranks [first, first + block).
        return storage[:, visible.positions[:, first : first + key_block]].permute(1, 0, 2, 3)[:, :, None]

    scores = torch.cat([pairwise_sum(q * gathered(keys, first)) for first in blocks], dim=-1)  # [rows, KV, G, width]
    scores = scores.masked_fill(~visible.valid[:, None, None, :], float("-inf"))
    # Masked ranks get weight exp(-inf) = 0: a zero after the row's keys (only a zero's sign can
    # differ from plain decoding's, which the int8 quantization after attention erases).
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    total = pairwise_sum(weights)  # [rows, KV, G]
    partials = [pairwise_sum(weights[..., first : first + key_block, None] * gathered(values, first), dim=-2)
                for first in blocks]  # each [rows, KV, G, HD]: a subtree of the whole sum
    weighted = pairwise_sum(torch.stack(partials, dim=-2), dim=-2)
    return (weighted / total[..., None]).reshape(rows, heads, head_dim)


def is_batch_invariant(device: torch.device | str) -> bool:
    """True when, on `device`, the norm, SwiGLU and attention give rows the same bits alone as in a
    batch, and a tree row the bits of the same keys committed in order: the elementwise functions
    behave as this module needs. A startup probe on random data (ascend.startup_ops)."""
    generator = torch.Generator().manual_seed(0)
    rows, dim, heads, kv_heads, head_dim = 37, 200, 4, 2, 16
    x = (torch.randn(rows, dim, generator=generator) * 3).to(device)
    weight = (torch.rand(dim, generator=generator) + 0.5).to(device)
    for batched, alone in ((rms_norm(x, weight, 1e-6), lambda i: rms_norm(x[i : i + 1], weight, 1e-6)),
                           (silu_mul(x), lambda i: silu_mul(x[i : i + 1]))):
        if not all(torch.equal(batched[i : i + 1], alone(i)) for i in range(rows)):
            return False
    # A tree of 4 step rows after 70 committed keys (row 3's ancestors: rows 0, 2, 3), against
    # row 3's path committed in order and decoded alone.
    keys = torch.randn(kv_heads, 80, head_dim, generator=generator)
    values = torch.randn(kv_heads, 80, head_dim, generator=generator)
    queries = torch.randn(4, heads, head_dim, generator=generator)
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree = attend(queries.to(device), keys.to(device), values.to(device), VisibleKeys.build(ancestors.to(device), 70))
    path = torch.cat([keys[:, :70], keys[:, [70, 72, 73]]], dim=1), torch.cat([values[:, :70], values[:, [70, 72, 73]]], dim=1)
    plain = attend(queries[3:].to(device), path[0].to(device), path[1].to(device),
                   VisibleKeys.build(torch.ones(1, 1, dtype=torch.bool, device=device), 72))
    return torch.equal(tree[3:].cpu(), plain.cpu())
