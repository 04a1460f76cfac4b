"""The simulated radix cache: which token prefixes a worker has already computed, within a token budget.

Each prefix is named by a chained hash of its tokens; a prompt's prefixes are touched longest first, so a
shorter prefix is always more recent than any longer one extending it and evicting the least recently used
entries drops the deepest tokens first (a radix tree's leaves). One entry stands for one cached token.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._entries: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _hashes(ids: list[int]) -> list[int]:
        out, h = [], 0
        for token in ids:
            h = hash((h, token))
            out.append(h)
        return out

    def match(self, ids: list[int]) -> int:
        """Tokens of ``ids`` already cached; like SGLang, at least the last token is always computed."""
        entries, matched = self._entries, 0
        for h in self._hashes(ids[:-1]):
            if h not in entries:
                break
            matched += 1
        return matched

    def clear(self) -> None:
        self._entries.clear()

    def insert(self, ids: list[int]) -> None:
        entries = self._entries
        for h in reversed(self._hashes(ids)):
            if h in entries:
                entries.move_to_end(h)
            else:
                entries[h] = None
        while len(entries) > self.capacity:
            entries.popitem(last=False)
