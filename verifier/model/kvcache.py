"""Where a session's keys and values live: a contiguous cache of its own, or blocks of a shared pool.

Both classes offer the model the same small protocol: `length` committed positions, `reserve`,
`begin_step(steps)` before a forward, `store(layer, kv)` for the step's rows, `load(layer, end)`
for positions [0, end) as keys and values [1, n_kv_heads, end, head_dim] in fp64 (what the fp64
attention computes in) or, with dtype, widened to it (fixed_order.py's fp32; the CPU kernel reads
the storage itself), and `commit(slots)` to keep the accepted rows of the step. A pool stores
what its model asks (fp32, or bf16 with --kv-cache-dtype bfloat16 and in the device engine); a
KVCache stores fp32. With the same dtype, where the numbers live cannot change a logit.

`KVCache` (kv_contiguous.py) is one session's tensors (tests, tools). `KVPool` is the serving
design: one preallocated tensor cut into fixed-size blocks; a `PagedCache` owns a list of blocks
and gathers its positions per step. Capacity is explicit and bounded: running out raises
ResourceExhausted, which the servicer turns into RESOURCE_EXHAUSTED, instead of growing until
the process dies. Full blocks of finished prompts stay findable by their tokens
(prefix_cache.py): a prompt that starts the same way holds them instead of computing them.

A session may also be *promised* blocks up front (`PagedCache.promise`): the pool counts them as
taken although no block is handed out until the session grows into them, so a session admitted
with what it may use never finds the pool full mid-way, whatever its neighbours do, while its
pages still cost memory only as they are used.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from pardec.runtime.errors import ResourceExhausted
from pardec.verifier.model.kv_placement import place
from pardec.verifier.model.prefix_cache import PrefixIndex

if TYPE_CHECKING:
    from pardec.verifier.model.args import ModelArgs


class KVPool:
    """All sessions' keys and values in one preallocated tensor of fixed-size blocks.

    Layout [n_layers, 2 (keys, values), n_kv_heads, slots, head_dim], head-major as in paged
    attention kernels: gathering blocks along the slot axis yields, per kv head, the keys as one
    contiguous [positions, head_dim] matrix, the operand attention's GEMMs want.

    fp32, like the model's keys and values, or bf16 (each rounded once, as it is stored). The CPU
    attention kernel (native_attention.py, a build per dtype) reads them in place through each
    session's slots; the fp64 fallback (attention.py) converts what it reads, one layer at a time.

    A session whose blocks are adjacent is read as a slice, as fast as a contiguous KVCache;
    otherwise its blocks are gathered, which costs more the longer the session. So `allocate`
    works to keep sessions adjacent.
    """

    def __init__(self, args: "ModelArgs", capacity_tokens: int, block_tokens: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        if block_tokens < 1 or capacity_tokens < block_tokens:
            raise ValueError(f"pool of {capacity_tokens} tokens cannot hold one block of {block_tokens}")
        self.block_tokens = block_tokens
        self.n_blocks = capacity_tokens // block_tokens
        self.max_position = args.max_position
        self.n_kv_heads = args.n_kv_heads
        # One block past the last is never handed out: the device engine's padding rows write
        # their keys and values there (device_forward.py).
        self.scratch_block = self.n_blocks
        slots = (self.n_blocks + 1) * block_tokens
        # torch.empty reserves address space; the OS commits pages only when a block is first
        # written, so a large pool costs memory in proportion to its use, not its capacity.
        # fp32 or bf16 (storage precision is per element, so a row's keys read back the same
        # whatever else was stored).
        self.kv = torch.empty((args.n_layers, 2, args.n_kv_heads, slots, args.head_dim), dtype=dtype, device=device)
        # The same memory by block: [n_layers, 2, n_kv_heads, blocks, block_tokens, head_dim].
        self.blocks_view = self.kv.view(*self.kv.shape[:3], self.n_blocks + 1, block_tokens, args.head_dim)
        self._free = set(range(self.n_blocks))
        # Blocks promised to sessions and not yet handed to them: the sum over sessions of
        # max(0, promised - held). Only the free blocks beyond these are anyone's to take.
        self._promised = 0
        self._offsets = torch.arange(block_tokens, device=device)
        # The sessions holding blocks, so that a new one is not placed where another will grow.
        self._sessions: "weakref.WeakSet[PagedCache]" = weakref.WeakSet()
        # Blocks ever handed out: their pages are committed, the pool's share of the process's RSS.
        self._ever_taken = bytearray(self.n_blocks)
        self.touched_blocks = 0
        # Full blocks findable by the tokens they hold, for prompts that start the same way.
        # An idle one (held by no session) is free, taken back only when no other free block is.
        self.prefixes = PrefixIndex(block_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.n_blocks * self.block_tokens

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.block_tokens

    @property
    def touched_bytes(self) -> int:
        return self.touched_blocks * self.kv[:, :, :, : self.block_tokens].numel() * self.kv.element_size()

    @property
    def unpromised_blocks(self) -> int:
        """Free blocks that no session was promised: what a new promise, or a session growing
        past its own promise, may take."""
        return len(self._free) - self._promised

    def promise(self, count: int, why: str) -> None:
        """Sets `count` blocks aside for a session that will grow into them (PagedCache.promise)."""
        if count > self.unpromised_blocks:
            raise ResourceExhausted(
                f"kv pool: {why} may use {count * self.block_tokens} tokens of KV cache, "
                f"{self.unpromised_blocks * self.block_tokens} of {self.capacity_tokens} are free or "
                "unpromised (kv_pool_tokens); retry after other sessions finish, or raise kv_pool_tokens"
            )
        self._promised += count

    def _adjust_promised(self, delta: int) -> None:
        self._promised += delta

    def store(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Writes step rows kv [rows, 2 * n_kv_heads, head_dim] (keys then values) at `slots`:
        one op for every session of a forward (see step.StepPlan)."""
        rows = kv.view(kv.shape[0], 2, self.n_kv_heads, kv.shape[-1]).permute(1, 2, 0, 3)
        self.kv[layer].index_copy_(2, slots, rows.to(self.kv.dtype))  # a bf16 pool: rounded to nearest, ties to even

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def allocate(self, count: int, why: str, after: int | None = None, covered: int = 0,
                 room: int = 0, adjacent_only: bool = False) -> list[int]:
        """`count` free blocks, as adjacent as possible, since an adjacent session is read as a
        slice instead of a gather: right after block `after` when those are free (a session
        growing in place), else where kv_placement.place puts a session that may grow to `room`
        blocks. `covered` of them are the caller's own promise (or given back at once); the rest
        must be unpromised, so that no session takes what another was promised. `adjacent_only`:
        none ([]) unless those blocks are one adjacent run (a cached prefix among them stays)."""
        uncovered = count - min(count, covered)
        if count > len(self._free) or uncovered > self.unpromised_blocks:
            raise ResourceExhausted(
                f"kv pool: {why} needs {count * self.block_tokens} more tokens of KV cache, "
                f"{max(0, self.unpromised_blocks) * self.block_tokens} of {self.capacity_tokens} are free "
                "(kv_pool_tokens); retry after other sessions finish, or raise kv_pool_tokens"
            )
        free = self._takeable(count)
        if after is not None and all(after + i in free for i in range(1, count + 1)):
            taken = list(range(after + 1, after + 1 + count))
        else:
            taken = place(free, self._growth_room(), count, room)
        if adjacent_only and any(block != taken[0] + i for i, block in enumerate(taken)):
            return []
        self._free.difference_update(taken)
        for block in taken:
            self.prefixes.forget(block)
            self.touched_blocks += not self._ever_taken[block]
            self._ever_taken[block] = 1
        return taken

    def _takeable(self, count: int) -> set[int]:
        """The free blocks an allocation of `count` may take: every one holding no prefix, and
        of the idle prefixes only as many as it lacks, those idle longest."""
        idle = self.prefixes.idle_blocks()
        if not idle:
            return self._free
        return self._free.difference(idle[max(0, count - (len(self._free) - len(idle))) :])

    def take_prefix(self, blocks: list[int], why: str, covered: int) -> None:
        """Hands a session the indexed blocks `blocks` (PrefixIndex.match). Those idle leave the
        free blocks, so, as in allocate, `covered` of them are the session's own promise and the
        rest must be unpromised."""
        idle = [block for block in blocks if block in self._free]
        if len(idle) - min(len(idle), covered) > self.unpromised_blocks:
            raise ResourceExhausted(
                f"kv pool: {why} needs {len(idle) * self.block_tokens} tokens of cached prefix, "
                f"{max(0, self.unpromised_blocks) * self.block_tokens} of {self.capacity_tokens} are free "
                "(kv_pool_tokens); retry after other sessions finish, or raise kv_pool_tokens"
            )
        for block in blocks:
            self.prefixes.hold(block)
        self._free.difference_update(idle)

    def _growth_room(self) -> set[int]:
        """The free blocks right above each adjacent session, up to what it may grow to."""
        room: set[int] = set()
        for session in self._sessions:
            if session.blocks and session._run_start is not None:
                end = min(session.blocks[0] + session._room(0), self.n_blocks)
                room.update(range(session.blocks[-1] + 1, end))
        return room

    def release(self, blocks: list[int]) -> None:
        """A session lets go of `blocks`; a prefix block other sessions still hold stays taken.
        The last block is let go first, so that a cached prefix is taken back from its end: its
        start, which every prompt behind it needs, stays findable longest."""
        self._free.update(block for block in reversed(blocks) if self.prefixes.release(block))

    def slots_of(self, blocks: list[int]) -> torch.Tensor:
        if not blocks:
            return self._offsets[:0]
        ids = torch.tensor(blocks, dtype=torch.int64, device=self._offsets.device)
        return (ids[:, None] * self.block_tokens + self._offsets).view(-1)

    def session(self) -> "PagedCache":
        session = PagedCache(self)
        self._sessions.add(session)
        return session


class PagedCache:
    """One session's positions in a KVPool: a block list, and the slot of every position."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.max_position = pool.max_position
        self.blocks: list[int] = []
        self.slots = pool.slots_of([])
        self.length = 0
        self.step_size = 0
        self.step_slots = self.slots
        self.block_ids = self.slots  # the blocks as a tensor, for gathers
        # Blocks the pool promised this session (promise): it grows into them without asking.
        self.promised = 0
        # First slot of the session when its blocks are adjacent in the pool (then a position
        # range is a plain slice, no gather), else None.
        self._run_start: int | None = None

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_tokens

    def _room(self, missing: int) -> int:
        """Blocks a new run for this session should leave room for: its promise, or without one
        twice what it holds then, so that it can grow in place for a while."""
        held = len(self.blocks) + missing
        return max(held, self.promised) if self.promised else 2 * held

    def _outstanding(self) -> int:
        return max(0, self.promised - len(self.blocks))

    def promise(self, tokens: int, why: str) -> None:
        """Has the pool set aside blocks for `tokens` positions in all, which this session then
        grows into without ever finding the pool full; ResourceExhausted, changing nothing,
        when they are not there. Kept until free()."""
        blocks = self.pool.blocks_for(tokens)
        before = self._outstanding()
        extra = max(0, blocks - len(self.blocks)) - before
        if extra > 0:
            self.pool.promise(extra, why)
        else:
            self.pool._adjust_promised(extra)
        self.promised = blocks

    def adopt(self, blocks: list[int], why: str) -> None:
        """Starts this empty session on the indexed blocks of its prompt's first positions
        (PrefixIndex.match), which then count as committed; ResourceExhausted, changing nothing,
        when the pool cannot hand out those that are idle."""
        before = self._outstanding()
        self.pool.take_prefix(blocks, why, covered=before)
        self.blocks = list(blocks)
        self.slots = self.pool.slots_of(self.blocks)
        self.length = len(blocks) * self.pool.block_tokens
        self._update_run()
        self.pool._adjust_promised(self._outstanding() - before)

    def reserve(self, extra: int, why: str = "this step") -> None:
        needed = self.length + extra
        if needed > self.max_position:
            raise ValueError(f"sequence of {needed} positions exceeds the {self.max_position} served (the model's "
                             "context, or the verifier's max_seq_len)")
        missing = self.pool.blocks_for(needed) - len(self.blocks)
        if missing <= 0:
            return
        before = self._outstanding()
        new = self.pool.allocate(missing, why, after=self.blocks[-1] if self._run_start is not None else None,
                                 covered=before, room=self._room(missing))
        # A session holding any indexed prefix block is not moved: another session may hold it
        # too, and then the move would keep it taken beside the run (more than the promise).
        moving = self._run_start is None or new[0] != self.blocks[-1] + 1 if self.blocks else False
        if moving and not any(block in self.pool.prefixes for block in self.blocks):
            self._relocate(new, why, before)
        else:
            self.blocks += new
            self.slots = torch.cat([self.slots, self.pool.slots_of(new)])
            self._update_run()
        self.pool._adjust_promised(self._outstanding() - before)

    def _relocate(self, new: list[int], why: str, covered: int) -> None:
        """Could not grow in place: move to one adjacent run if the pool has one, so that every
        later step reads a slice instead of gathering (one copy of the session's positions, the
        cost of a few steps' gathers), else just add the scattered blocks."""
        self.pool.release(new)
        try:
            # Held for a moment beside the session's old blocks, which go back right after the
            # copy: only the `new` blocks stay taken, and those the first allocate allowed.
            whole = len(self.blocks) + len(new)
            run = self.pool.allocate(whole, why, covered=whole, room=self._room(whole - len(self.blocks)),
                                     adjacent_only=True)
        except ResourceExhausted:
            run = []
        if run:
            target = self.pool.slots_of(run[: len(self.blocks)])
            self.pool.kv[:, :, :, target] = self.pool.kv[:, :, :, self.slots]
            self.pool.release(self.blocks)
            self.blocks = run
        else:
            self.blocks += self.pool.allocate(len(new), why, covered=covered)
        self.slots = self.pool.slots_of(self.blocks)
        self._update_run()

    def _update_run(self) -> None:
        self.block_ids = torch.tensor(self.blocks, dtype=torch.int64, device=self.slots.device)
        first = self.blocks[0] if self.blocks else 0
        adjacent = all(block == first + i for i, block in enumerate(self.blocks))
        self._run_start = first * self.pool.block_tokens if self.blocks and adjacent else None

    def begin_step(self, steps: int) -> None:
        if self.length + steps > self.capacity:
            raise ValueError(f"cache holds {self.capacity} positions; reserve {steps} beyond {self.length} first")
        self.step_size = steps
        self.step_slots = self.slots[self.length : self.length + steps]

    def store(self, layer: int, kv: torch.Tensor) -> None:
        # kv [steps, 2 * n_kv_heads, head_dim]; a batched forward stores all sessions at once instead.
        self.pool.store(layer, self.step_slots, kv)

    def load(self, layer: int, end: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        if self._run_start is not None:
            kv = self.pool.kv[layer, :, :, self._run_start : self._run_start + end]
        else:
            blocks = self.block_ids[: self.pool.blocks_for(end)]
            kv = self.pool.blocks_view[layer].index_select(2, blocks)
            kv = kv.view(*kv.shape[:2], -1, kv.shape[-1])[:, :, :end]
        kv = kv.to(dtype)
        return kv[0:1], kv[1:2]

    def commit(self, slots: torch.Tensor, trim: bool = True) -> None:
        """Keeps the step rows `slots` as the next positions; with trim, gives back the blocks
        past them (a prompt being cached in chunks keeps the blocks reserved for the rest)."""
        # The step rows are host integers: deciding whether anything moves needs no device sync.
        rows = slots.tolist()
        count = len(rows)
        if count and (min(rows) < 0 or max(rows) >= self.step_size):
            raise ValueError(f"commit slots must index the last step's {self.step_size} rows")
        if rows != list(range(count)):  # the kept rows are not already where they belong
            device = self.slots.device
            source = self.slots[self.length + torch.tensor(rows, dtype=torch.int64, device=device)]
            target = self.slots[self.length : self.length + count]
            # Gathers before it writes, so overlapping source and target rows are safe.
            self.pool.kv[:, :, :, target] = self.pool.kv[:, :, :, source]
        self.length += count
        self.step_size = 0
        if trim:
            self.trim()

    def trim(self) -> None:
        """Gives back the blocks past the committed positions (the rejected part of a step),
        but one: the next step needs it, and keeping it keeps a session's blocks adjacent."""
        keep = self.pool.blocks_for(self.length) + 1
        if keep < len(self.blocks):
            before = self._outstanding()
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self.slots = self.slots[: keep * self.pool.block_tokens]
            self._update_run()
            self.pool._adjust_promised(self._outstanding() - before)

    def free(self) -> None:
        """Gives back every block, and the promise."""
        self.pool._adjust_promised(-self._outstanding())
        self.promised = 0
        self.pool.release(self.blocks)
        self.blocks = []
        self.slots = self.slots[:0]
        self.length = self.step_size = 0
        self._update_run()
