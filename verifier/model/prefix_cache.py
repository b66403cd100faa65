"""Which KV pool blocks hold which token prefixes, so that a prompt starting as an earlier one
did (a system prompt, a few-shot preamble, the conversation so far) skips computing them.

A full block of a session's committed positions is named by its tokens and every token before
it: a chain of digests, one per block. Reusing such a block is exact, not approximate: a row's
keys and values depend only on its position and the tokens up to it, never on the batch, the
tree or the prefill chunk that computed it (model.forward_batch), so the block holds the very
numbers a new prefill of those tokens would write.

Worked example, blocks of 2 tokens. A session of prompt [5, 6, 7, 8, 9] remembers blocks 3 and
4 (positions [0, 4); [9] does not fill a block):

>>> index = PrefixIndex(block_tokens=2)
>>> index.remember([3, 4, 1], [5, 6, 7, 8, 9])
>>> index.match([5, 6, 7, 8, 1, 2], limit=3), index.match([5, 6, 0, 8], limit=2)
([3, 4], [3])

A session holding a block keeps it from reuse by anyone else's writes; when the last holder lets
go the block is *idle*: free in the pool, still findable, and the first to be taken back when
the pool runs short is the one idle longest:

>>> index.release(3), index.idle_blocks()      # the remembering session let go of block 3
(True, [3])
>>> index.hold(3), index.hold(4), index.release(4), index.release(4), index.idle_blocks()
(True, False, False, True, [4])
>>> index.forget(4); index.match([5, 6, 7, 8], limit=2)
[3]
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence


def block_digests(tokens: Sequence[int], block_tokens: int, count: int, scope: str = "") -> Iterator[bytes]:
    """The chain digests of the first full blocks of `tokens`, at most `count`: each names a
    block's tokens, every token before it and the `scope` (who may share it: a tenant). The
    gateway names prompts the same way to send a conversation back to the replica that holds its
    blocks (gateway/prefix_affinity.py)."""
    digest = hashlib.blake2b(scope.encode(), digest_size=16).digest() if scope else b""
    for at in range(0, min(count, len(tokens) // block_tokens) * block_tokens, block_tokens):
        block = array("q", tokens[at : at + block_tokens]).tobytes()
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        yield digest


class PrefixIndex:
    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self._block_of: dict[bytes, int] = {}  # chain digest -> block
        self._digest_of: dict[int, bytes] = {}  # block -> chain digest
        self._holders: dict[int, int] = {}  # indexed block -> sessions holding it (0: idle)
        # Indexed blocks nobody holds, least recently let go first: they are in the pool's free
        # set, and the pool takes the oldest of them when it has no other free block.
        self._idle: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._digest_of

    def match(self, tokens: Sequence[int], limit: int, scope: str = "") -> list[int]:
        """The blocks holding the longest prefix of `tokens` indexed under `scope`, at most
        `limit` blocks."""
        blocks = []
        for digest in block_digests(tokens, self.block_tokens, limit, scope):
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def remember(self, blocks: Sequence[int], tokens: Sequence[int], scope: str = "") -> None:
        """Indexes, under `scope`, the full blocks of a session holding `blocks` whose positions
        hold `tokens`. A block indexed already (found by match) keeps its entry; a prefix another
        block holds already leaves this session's copy private."""
        count = min(len(blocks), len(tokens) // self.block_tokens)
        for block, digest in zip(blocks, block_digests(tokens, self.block_tokens, count, scope)):
            if block in self._digest_of or digest in self._block_of:
                continue
            self._block_of[digest], self._digest_of[block] = block, digest
            self._holders[block] = 1

    def hold(self, block: int) -> bool:
        """One more session holds an indexed block; True when it was idle (free in the pool)."""
        was_idle = self._holders[block] == 0
        self._holders[block] += 1
        self._idle.pop(block, None)
        return was_idle

    def release(self, block: int) -> bool:
        """A session lets go of `block`; True when nobody holds it now (it is free in the pool)."""
        if block not in self._digest_of:
            return True
        self._holders[block] -= 1
        if self._holders[block]:
            return False
        self._idle[block] = None
        return True

    def forget(self, block: int) -> None:
        """The pool takes an idle block for new contents: it is no longer findable."""
        digest = self._digest_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest], self._holders[block]
            self._idle.pop(block, None)

    def idle_blocks(self) -> list[int]:
        """The idle blocks, least recently let go first."""
        return list(self._idle)

    @property
    def idle_count(self) -> int:
        return len(self._idle)
