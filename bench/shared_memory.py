"""The stack's shared drafting memories, saved and put back around a benchmark's parallel arms.

A memory shared across requests holds every earlier answer. `pardec bench` repeats the same
prompts round after round, so a memory left to grow would draft each prompt from its own earlier
output: a gain no new request gets. Each parallel arm therefore starts from one saved state,
what the memory learned from prompts that are not measured, and only what the arm itself serves
is added to it, as on a server.
"""

from __future__ import annotations

import redis

from pardec.drafter.config import DrafterConfig


class SharedMemorySnapshot:
    """Every shared memory in the stack's Redis: cleared, saved, restored (DUMP and RESTORE, so the
    drafter's own layout travels untouched)."""

    def __init__(self, redis_url: str, key_prefix: str = DrafterConfig.key_prefix):
        self._client = redis.Redis.from_url(redis_url)
        # drafter.memory.SharedMemory.keys: `<prefix>:{shared:<tenant/model>}:<part>`.
        self._pattern = f"{key_prefix}:{{shared:*"
        self._saved: dict[bytes, tuple[bytes, int]] = {}

    def keys(self) -> list[bytes]:
        return list(self._client.scan_iter(match=self._pattern, count=1000))

    def clear(self) -> None:
        keys = self.keys()
        if keys:
            self._client.delete(*keys)

    def save(self) -> int:
        """Remembers the memories as they are now; returns how many keys."""
        saved = {key: (self._client.dump(key), self._client.pttl(key)) for key in self.keys()}
        self._saved = {key: state for key, state in saved.items() if state[0] is not None}  # None: expired since
        return len(self._saved)

    def contexts(self) -> int:
        """Two-token contexts held, over every memory (each memory's `:contexts` hash)."""
        return sum(self._client.hlen(key) for key in self.keys() if key.endswith(b":contexts"))

    def close(self) -> None:
        self._client.close()

    def restore(self) -> None:
        """Puts the memories back as `save` found them, dropping whatever was learned since."""
        self.clear()
        for key, (value, ttl_ms) in self._saved.items():
            self._client.restore(key, max(ttl_ms, 0), value, replace=True)  # 0: no expiry
