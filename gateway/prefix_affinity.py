"""Which verifier replica's prefix cache likely holds which prompt starts, as the gateway saw
sessions go by: a new session goes where the longest start of its prompt was served, unless that
replica is much busier than the least busy one.

Each replica keeps the full blocks of the prompts it prefilled and, at release, of each session's
prompt and output (verifier/model/prefix_cache.py), so a conversation's next turn or another
request behind the same system prompt skips their prefill only on that replica. The gateway names
blocks as the verifier does (block_digests, with the block size the replicas report) and
remembers the last `capacity` it sent to each; what the replica has since dropped only costs a
preference. Balance comes first: a replica more than `slack` sessions above the least busy is
not chosen for its cache.

Worked example, blocks of 2 tokens, two replicas:

>>> affinity = PrefixAffinity(replicas=2, block_tokens=2)
>>> affinity.served(1, [7, 8, 9, 10, 11])       # replica 1 served a prompt
>>> affinity.choose([0, 1], [0, 0], [7, 8, 9, 10, 3, 4])  # two blocks of this one are there
1
>>> affinity.choose([0, 1], [0, 3], [7, 8, 9, 10, 3, 4])  # ... but replica 1 is 3 sessions busier
>>> affinity.forget(1); affinity.choose([0, 1], [0, 0], [7, 8, 9, 10, 3, 4])  # it restarted
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from pardec.verifier.model.prefix_cache import block_digests

# Blocks remembered per replica: a few times what a default KV pool holds (65,536 positions in
# blocks of 32), at ~100 bytes each.
CAPACITY = 16_384
# How many sessions above the least busy replica one may be and still be chosen for its cache.
SLACK = 2


class PrefixAffinity:
    def __init__(self, replicas: int, block_tokens: int, capacity: int = CAPACITY, slack: int = SLACK):
        self.block_tokens, self.capacity, self.slack = block_tokens, capacity, slack
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self._lock = threading.Lock()

    def served(self, replica: int, tokens: Sequence[int], scope: str = "") -> None:
        """Replica `replica` holds (or held) the keys and values of `tokens`, cached under `scope`."""
        digests = list(block_digests(tokens, self.block_tokens, len(tokens), scope))
        with self._lock:
            seen = self._seen[replica]
            for digest in digests:
                seen[digest] = None
                seen.move_to_end(digest)
            while len(seen) > self.capacity:
                seen.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica lost its cache (it failed, and may have restarted)."""
        with self._lock:
            self._seen[replica].clear()

    def choose(
        self, candidates: Sequence[int], load: Sequence[int], tokens: Sequence[int], scope: str = ""
    ) -> int | None:
        """Of the `candidates` (healthy replicas; `load`: sessions per replica), the one whose
        cache holds the longest start of `tokens` under `scope` (all but the last token, which
        is computed anyway), among those at most `slack` above the least busy; None when none
        holds any."""
        if not candidates:
            return None
        digests = list(block_digests(tokens, self.block_tokens, (len(tokens) - 1) // self.block_tokens, scope))
        least = min(load[replica] for replica in candidates)
        best, best_blocks = None, 0
        with self._lock:
            for replica in candidates:
                if load[replica] > least + self.slack:
                    continue
                seen, blocks = self._seen[replica], 0
                while blocks < len(digests) and digests[blocks] in seen:
                    blocks += 1
                if blocks > best_blocks or (blocks == best_blocks and best is not None and load[replica] < load[best]):
                    best, best_blocks = replica, blocks
        return best if best_blocks else None
