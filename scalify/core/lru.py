"""A bounded cache that forgets the least recently used entry (traced jaxprs, re-wrapped jits)."""
from __future__ import annotations

import collections
from typing import Any, Hashable


class LRUCache:
    """At most `maxsize` entries; `get` marks an entry as used, `put` evicts the oldest one.

    Keys must be hashable (`get`/`put` raise TypeError otherwise, as a dict does).
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable) -> Any:
        """The entry of `key` (now the most recently used one), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
