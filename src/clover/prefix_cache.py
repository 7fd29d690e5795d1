"""Prompt-prefix reuse: K/V pages and GDN state kept at page boundaries where prefill chunks end (GDN state exists
only where a forward ended; where the decoder ends a chunk: docs/ARCHITECTURE.md, "Engine core").

An entry is a token prefix of whole pages with references to its pages and to the slot holding the GDN state after
it (slots are never rewritten, cache.py, so an entry copies nothing). A request whose prompt starts with an entry
shares those (a partly shared page is copied before a write, `StatePool._make_writable`) and prefills the rest.
Least recently used entries go first, when a page or slot is needed and none is free, and past a third of the slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass
class PrefixEntry:
    tokens: tuple
    pages: tuple
    slot: int | None


class PrefixCache:
    def __init__(self, pool):
        self.pool = pool
        self._entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()   # by tokens, least recently used first
        # per the pool's `RefCounts` (cache.py: its pages, its slots): id → entries holding it
        self._holds = {pool.page_ids: Counter(), pool.slot_ids: Counter()}
        self.lookups = self.hits = self.reused_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens, seq) -> bool:
        """Keep `seq`'s state after `tokens` (its first len(tokens) tokens; its length must equal that
        and be a multiple of the page size). Returns whether an entry was added."""
        pool, n = self.pool, len(tokens)
        if n == 0 or n % pool.page_size or seq.length != n or seq.spec_start is not None:
            return False
        key = tuple(tokens)
        with pool._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return False
            while len(self._entries) >= max(1, pool.num_slots // 3):
                self.evict_one()
            entry = PrefixEntry(key, tuple(seq._held.pages[: n // pool.page_size]),
                                seq._held.slot if pool.has_gdn else None)
            for ids, held in self._held_ids(entry):
                for i in held:
                    ids.ref(i)
                    self._holds[ids][i] += 1
            self._entries[key] = entry
            return True

    def lookup(self, prompt) -> PrefixEntry | None:
        """The longest entry that is a prefix of `prompt` and leaves at least one token to compute."""
        self.lookups += 1
        with self.pool._lock:
            lengths = sorted({len(e.tokens) for e in self._entries.values()}, reverse=True)
            for n in lengths:
                if n >= len(prompt):
                    continue
                entry = self._entries.get(tuple(prompt[:n]))
                if entry is not None:
                    self._entries.move_to_end(entry.tokens)
                    self.hits += 1
                    self.reused_tokens += n
                    return entry
        return None

    def attach(self, entry: PrefixEntry, seq) -> int:
        """Start the new, empty `seq` from `entry`: its pages and slot are shared. Returns the tokens reused."""
        pool, held = self.pool, seq._held
        if seq.length or held.pages:
            raise ValueError("a cached prefix can only start an empty sequence")
        with pool._lock:
            for p in entry.pages:
                pool.page_ids.ref(p)
            held.pages = list(entry.pages)
            # the shared pages need no reservation of their own
            pool._reserve(held, -min(held.reserved_pages, len(entry.pages)), 0)
            if entry.slot is not None:
                pool._seq_set_slot(held, entry.slot)
            seq.length = len(entry.tokens)
        return len(entry.tokens)

    def evict_one(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        with self.pool._lock:
            if not self._entries:
                return False
            _, entry = self._entries.popitem(last=False)
            for ids, held in self._held_ids(entry):
                holds = self._holds[ids]
                for i in held:
                    holds[i] -= 1
                    if not holds[i]:
                        del holds[i]
                    ids.drop(i)
            self.evictions += 1
            return True

    def _held_ids(self, entry: PrefixEntry):
        """Per `RefCounts` of the pool (its pages, its slots), the ids `entry` holds."""
        return ((self.pool.page_ids, entry.pages), (self.pool.slot_ids, () if entry.slot is None else (entry.slot,)))

    def clear(self) -> None:
        while self.evict_one():
            pass

    def evictable(self, ids) -> int:
        """Pages (`pool.page_ids`) or slots (`pool.slot_ids`) that only entries hold: evicting every
        entry would free them."""
        return sum(1 for i, n in self._holds[ids].items() if ids.refs[i] == n)

    def stats(self) -> dict:
        return {"prefix_entries": len(self._entries), "prefix_lookups": self.lookups, "prefix_hits": self.hits,
                "prefix_reused_tokens": self.reused_tokens, "prefix_evictions": self.evictions}
