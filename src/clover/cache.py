"""The state pool: every sequence's K/V pages and GDN slots, in tensors allocated once per layer on its device
(docs/ARCHITECTURE.md, "Engine core" and "Rules the code keeps").

Position p of a page table is row `p % page_size` of page `table[p // page_size]`. Pages are refcounted, shared
read-only (prefix cache, forks) and copied before a write. A slot is never written after the forward that fills
it (slot 0: the zero state). Block forwards change no sequence: their K/V are scratch rows past its length, and
they write no slot. Layers see only a `ForwardBatch`; `SequenceState` is the handle the generation loop holds.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .layers.norms import compute_dtype
from .prefix_cache import PrefixCache
from .transfer import device_tensor, to_device

PAGE_SIZE = 32


def page_rows(table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of a `[pages · page_size, …]` view holding positions `pos` of page table `table` (`table`
    [pages] with `pos` [n], or `table` [B, pages] with `pos` [B, n], a table per row)."""
    return table.gather(-1, pos // page_size) * page_size + pos % page_size


class PoolFull(RuntimeError):
    """The state pool has no free page or slot left, even after evicting cached prefixes."""


@dataclass
class ForwardBatch:
    """One cached forward, per row: all the layers need to read and write the pool.

    `starts[b]`: tokens row b has cached (its T new tokens' K/V go to positions starts[b] …, the block's as
    scratch). `commits[b]`: how many become state (T − block_len, or the row's own length when `padded`).
    `pages[b]`: its page table, covering starts[b] + T. `read_slots` / `write_slots`: the GDN slot a row
    reads / its committed state goes to (None: nothing committed). `records`: per row, per GDN layer, a list
    receiving the committed inputs (an open speculation, see `SequenceState.rollback`), or None.
    `stepwise`: the causal tokens must come out exactly as one-token steps compute them, else a kernel may
    take a prompt's tokens together (which forwards are which: docs/ARCHITECTURE.md, "Rules the code keeps")."""

    pool: "StatePool"
    starts: list[int]
    commits: list[int]
    block_len: int
    pages: list[list[int]]
    read_slots: list[int]
    write_slots: list[int] | None
    records: list | None
    padded: bool = False
    stepwise: bool = False
    _table: torch.Tensor | None = field(default=None, repr=False)
    _index: dict = field(default_factory=dict, repr=False)

    def row(self, b: int) -> "ForwardBatch":
        """Row b alone over its own `commits[b]` tokens: how a mixing op runs a right-padded batch (backend.py)."""
        write = None if self.write_slots is None else [self.write_slots[b]]
        records = None if self.records is None else [self.records[b]]
        return ForwardBatch(self.pool, [self.starts[b]], [self.commits[b]], self.block_len, [self.pages[b]],
                            [self.read_slots[b]], write, records, stepwise=self.stepwise)

    def page_table(self) -> torch.Tensor:
        """The rows' page tables, int32 [B, max pages], zero-padded (made once per forward)."""
        if self._table is None:
            width = max(1, max(len(p) for p in self.pages))
            self._table = torch.tensor([p + [0] * (width - len(p)) for p in self.pages], dtype=torch.int32)
        return self._table

    def index(self, device, T: int) -> "BatchIndex":
        """This forward's `BatchIndex` on `device` for T new tokens a row: one host-to-device copy per
        forward, not one per layer."""
        key = (torch.device(device), T)
        if key not in self._index:
            self._index[key] = BatchIndex.build(self, T, key[0])
        return self._index[key]


@dataclass
class BatchIndex:
    """A `ForwardBatch` as int64 device tensors, for T new tokens per row: `read_slots` [B], `write_rows` [W]
    (the rows that commit) and their `write_slots` [W], `starts` [B], `table` [B, N] (page tables, padded).
    The rest is derived on the device on first use; `derived` keeps what a backend computes once per
    forward for all its layers."""

    read_slots: torch.Tensor
    write_rows: torch.Tensor
    write_slots: torch.Tensor
    starts: torch.Tensor
    table: torch.Tensor
    tokens: int                    # T
    key_len: int                   # S: key positions 0 … S−1 cover every row (≥ the longest start + T)
    page_size: int
    uniform: bool                  # every row has the same start (no padding needed among keys)
    derived: dict = field(default_factory=dict, repr=False)

    @property
    def key_ends(self) -> torch.Tensor:
        """[B]: each row's end, starts + T."""
        return self.starts + self.tokens

    @property
    def new_rows(self) -> torch.Tensor:
        """[B·T]: the flat K/V rows (`[pages · page_size]` view) of each row's new tokens."""
        if "new_rows" not in self.derived:
            pos = self.starts[:, None] + torch.arange(self.tokens, device=self.starts.device)[None, :]
            self.derived["new_rows"] = page_rows(self.table, pos, self.page_size).reshape(-1)
        return self.derived["new_rows"]

    @property
    def key_rows(self) -> torch.Tensor:
        """[B, S]: flat rows of positions 0 … S−1; a row's entries past its own end repeat its last row
        (attention masks them)."""
        if "key_rows" not in self.derived:
            pos = torch.arange(self.key_len, device=self.starts.device)[None, :]
            pos = torch.minimum(pos, self.key_ends[:, None] - 1)                               # [B, S]
            self.derived["key_rows"] = page_rows(self.table, pos, self.page_size)
        return self.derived["key_rows"]

    @classmethod
    def build(cls, batch: ForwardBatch, T: int, device) -> "BatchIndex":
        P = batch.pool.page_size
        B = len(batch.starts)
        starts = torch.tensor(batch.starts, dtype=torch.long)
        table = batch.page_table().long()                                                       # [B, pages]
        write = batch.write_slots or [None] * B
        write_rows = torch.tensor([r for r, w in enumerate(write) if w is not None], dtype=torch.long)
        write_slots = torch.tensor([w for w in write if w is not None], dtype=torch.long)
        read = torch.tensor(batch.read_slots, dtype=torch.long)
        parts = [read, write_rows, write_slots, starts, table.reshape(-1)]
        flat = to_device(torch.cat(parts), device)                       # one host-to-device copy
        out = list(torch.split(flat, [t.numel() for t in parts]))
        out[4] = out[4].view(B, -1)
        return cls(*out, tokens=T, key_len=max(batch.starts) + T, page_size=P,
                   uniform=len(set(batch.starts)) == 1)


class RefCounts:
    """Reference-counted ids (the pool's pages, or its GDN slots) and the free ones; the first `pinned` are
    held for good."""

    def __init__(self, count: int, pinned: int = 0):
        self.refs = [1] * pinned + [0] * (count - pinned)
        self.free = list(range(count - 1, pinned - 1, -1))

    def take(self) -> int:
        i = self.free.pop()
        self.refs[i] = 1
        return i

    def ref(self, i: int) -> None:
        self.refs[i] += 1

    def drop(self, i: int | None) -> None:
        if i is not None:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.free.append(i)


@dataclass(slots=True)
class _Holdings:
    """What one sequence holds in the pool (kept apart from the handle so a finalizer can free it)."""

    pages: list[int] = field(default_factory=list)
    slot: int | None = 0
    saved_slot: int | None = None
    reserved_pages: int = 0
    reserved_slots: int = 0
    snapshot_slots: list[int] = field(default_factory=list)     # one reference per snapshot taken
    own_slots: list[int] = field(default_factory=list)          # taken out of the reservation (refunded when dropped)


class StatePool:
    """Pages of K/V and slots of GDN state for every sequence of one model, allocated once."""

    def __init__(self, config, dtype: torch.dtype, *, pages: int, slots: int, page_size: int = PAGE_SIZE,
                 devices=None):
        if page_size < 1 or pages < 1 or slots < 2:
            raise ValueError(f"a state pool needs page_size >= 1, pages >= 1 and slots >= 2, got "
                             f"{page_size}, {pages}, {slots}")
        self.config, self.dtype, self.page_size = config, dtype, page_size
        self.num_pages, self.num_slots = pages, slots
        self.state_dtype = compute_dtype(dtype)
        dev = (lambda i: devices[i]) if devices is not None else (lambda i: torch.device("cpu"))
        self.k, self.v, self.conv, self.recurrent = {}, {}, {}, {}
        with torch.inference_mode(False):         # plain tensors: forwards write them in and out of inference mode
            self._allocate(slots, pages, dev)
        self.has_gdn = bool(self.conv)
        self._lock = threading.RLock()
        self.page_ids = RefCounts(pages)
        self.slot_ids = RefCounts(slots, pinned=1)      # slot 0, the zero state: pinned, never written
        self.reserved_pages = 0                     # promised to sequences, not yet taken
        self.reserved_slots = 0
        self.prefix = PrefixCache(self)

    def _allocate(self, slots: int, pages: int, dev) -> None:
        c = self.config
        for i, kind in enumerate(c.layer_types):
            if kind == "linear_attention":
                self.conv[i] = torch.empty(slots, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype,
                                           device=dev(i))
                self.recurrent[i] = torch.empty(slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                                c.linear_value_head_dim, dtype=self.state_dtype, device=dev(i))
                self.conv[i][0].zero_()
                self.recurrent[i][0].zero_()
            else:
                shape = (pages, self.page_size, c.num_key_value_heads, c.head_dim)
                self.k[i] = torch.empty(shape, dtype=self.dtype, device=dev(i))
                self.v[i] = torch.empty(shape, dtype=self.dtype, device=dev(i))

    @staticmethod
    def bytes_per_page(config, dtype, page_size: int = PAGE_SIZE) -> int:
        e = dtype.itemsize
        attn = sum(1 for k in config.layer_types if k != "linear_attention")
        return attn * 2 * page_size * config.num_key_value_heads * config.head_dim * e

    @staticmethod
    def bytes_per_slot(config, dtype) -> int:
        e, se = dtype.itemsize, compute_dtype(dtype).itemsize
        gdn = sum(1 for k in config.layer_types if k == "linear_attention")
        per = config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * e
        per += config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * se
        return gdn * per

    @staticmethod
    def slots_for(max_sequences: int, prefix_slots: int | None = None) -> int:
        """GDN slots for `max_sequences`: slot 0, two per sequence (a forward writes a new one before
        dropping the old) and `prefix_slots` (default max_sequences) for cached prefixes."""
        return 1 + 2 * max_sequences + (max_sequences if prefix_slots is None else prefix_slots)

    @classmethod
    def for_budget(cls, config, dtype, memory_bytes: int, *, max_sequences: int = 16, prefix_slots: int | None = None,
                   page_size: int = PAGE_SIZE, devices=None) -> "StatePool":
        """A pool that fits `memory_bytes`: the GDN slots of `slots_for`; pages of K/V from what is left
        (at most enough for every sequence at the full context)."""
        slots = cls.slots_for(max_sequences, prefix_slots)
        slot_bytes, page_bytes = cls.bytes_per_slot(config, dtype), cls.bytes_per_page(config, dtype, page_size)
        left = memory_bytes - slots * slot_bytes
        ceiling = max_sequences * math.ceil(config.max_position_embeddings / page_size) + 1
        pages = ceiling if page_bytes == 0 else min(ceiling, left // page_bytes)
        if left <= 0 or pages < 2:
            raise ValueError(
                f"a state-pool budget of {memory_bytes} bytes is too small: {slots} GDN state slots take "
                f"{slots * slot_bytes} bytes and a page of {page_size} tokens' K/V takes {page_bytes}; "
                f"raise the cache memory or lower max_sequences")
        return cls(config, dtype, pages=int(pages), slots=slots, page_size=page_size, devices=devices)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v, self.conv, self.recurrent) for t in d.values())

    @property
    def free_pages(self) -> int:
        return len(self.page_ids.free)

    @property
    def free_slots(self) -> int:
        return len(self.slot_ids.free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def available_pages(self) -> int:
        """Pages a new reservation may count on: free ones, plus those only the prefix cache holds."""
        return self.free_pages + self.prefix.evictable(self.page_ids) - self.reserved_pages

    def available_slots(self) -> int:
        return self.free_slots + self.prefix.evictable(self.slot_ids) - self.reserved_slots

    def _take(self, ids: RefCounts) -> int:
        """A free page or slot (`ids`), evicting cached prefixes while there is none."""
        while not ids.free:
            if not self.prefix.evict_one():
                what = (f"{self.num_pages} K/V pages ({self.num_pages * self.page_size} tokens)" if ids is self.page_ids
                        else f"{self.num_slots} GDN state slots")
                raise PoolFull(f"the state pool's {what} are all in use")
        return ids.take()

    def take_scratch(self, tokens: int) -> tuple[list[int], int]:
        """Pages for `tokens` positions and one GDN slot (0 without GDN layers) that no sequence owns:
        where padded rows of a fixed-shape forward (the step graphs') write. PoolFull if not there."""
        with self._lock:
            need = self.pages_for(tokens)
            if self.available_pages() < need or (self.has_gdn and self.available_slots() < 1):
                raise PoolFull(f"the state pool has no room for {need} scratch pages and a slot")
            pages = [self._take(self.page_ids) for _ in range(need)]
            return pages, (self._take(self.slot_ids) if self.has_gdn else 0)

    def give_back_scratch(self, pages: list[int], slot: int) -> None:
        with self._lock:
            for page in pages:
                self.page_ids.drop(page)
            if self.has_gdn:
                self.slot_ids.drop(slot)

    def new_sequence(self, reserve_tokens: int = 0) -> "SequenceState":
        """A new, empty sequence. `reserve_tokens`: pages (and two GDN slots) set aside so that it can
        always grow to that length (what admission control promises); PoolFull if they are not there."""
        with self._lock:
            pages = self.pages_for(reserve_tokens) if reserve_tokens else 0
            slots = 2 if reserve_tokens and self.has_gdn else 0
            if pages > self.available_pages() or slots > self.available_slots():
                raise PoolFull(f"the state pool cannot reserve {pages} pages and {slots} slots "
                               f"({self.available_pages()} pages, {self.available_slots()} slots available)")
            held = _Holdings()
            self._reserve(held, pages, slots)
            self.slot_ids.ref(0)
            return SequenceState(self, held)

    def can_reserve(self, tokens: int) -> bool:
        with self._lock:
            return (self.pages_for(tokens) <= self.available_pages()
                    and (not self.has_gdn or 2 <= self.available_slots()))

    def _release(self, held: _Holdings) -> None:
        with self._lock:
            for page in held.pages:
                self.page_ids.drop(page)
            held.pages = []
            for slot in (held.slot, held.saved_slot, *held.snapshot_slots):
                self.slot_ids.drop(slot)
            held.slot, held.saved_slot, held.snapshot_slots, held.own_slots = None, None, [], []
            self._reserve(held, -held.reserved_pages, -held.reserved_slots)

    def _reserve(self, held: _Holdings, pages: int, slots: int) -> None:
        """Add pages and slots to a sequence's reservation (negative: take them out of it), and to the
        pool's totals with it: the one place the two move."""
        held.reserved_pages += pages
        held.reserved_slots += slots
        self.reserved_pages += pages
        self.reserved_slots += slots

    def _seq_take_page(self, held: _Holdings) -> int:
        """A fresh page for a sequence: out of its reservation while it has one, else one nobody was promised."""
        if held.reserved_pages:
            self._reserve(held, -1, 0)
        elif self.available_pages() < 1:
            raise PoolFull(f"the state pool is out of K/V pages ({self.num_pages} of {self.page_size} tokens, "
                           f"{self.reserved_pages} reserved by running requests)")
        return self._take(self.page_ids)

    def _grow(self, held: _Holdings, tokens: int) -> None:
        """Give a sequence pages up to `tokens` positions, its reservation first."""
        for _ in range(self.pages_for(tokens) - len(held.pages)):
            held.pages.append(self._seq_take_page(held))

    def _make_writable(self, held: _Holdings, start: int, stop: int) -> None:
        """Copy any shared page among positions start … stop−1 (copy-on-write: a cached prefix's last
        page may be partly filled, and the sequence that reuses it writes its own rows after it)."""
        P = self.page_size
        for i in range(start // P, min(self.pages_for(stop), len(held.pages))):
            page = held.pages[i]
            if self.page_ids.refs[page] > 1:
                fresh = self._seq_take_page(held)
                for d in (self.k, self.v):
                    for t in d.values():
                        t[fresh].copy_(t[page])
                self.page_ids.drop(page)
                held.pages[i] = fresh

    def _seq_take_slot(self, held: _Holdings) -> int:
        """A fresh slot for a sequence, out of its reservation while it has one left."""
        slot = self._take(self.slot_ids)
        if held.reserved_slots:
            self._reserve(held, 0, -1)
            held.own_slots.append(slot)
        return slot

    def _seq_set_slot(self, held: _Holdings, slot: int, taken: bool = False) -> None:
        """Move a sequence to GDN slot `slot`, letting go of its current one. `taken`: the caller already
        holds `slot`'s reference for it (a slot just taken), else one is added."""
        if not taken:
            self.slot_ids.ref(slot)
        old, held.slot = held.slot, slot
        self._seq_drop_slot(held, old)

    def _seq_drop_slot(self, held: _Holdings, slot: int | None) -> None:
        """A sequence lets go of one reference to `slot`; a slot it took out of its reservation gives
        the reservation back (a sequence is promised two slots at a time, not two in its life)."""
        if slot is None:
            return
        if slot in held.own_slots:
            held.own_slots.remove(slot)
            self._reserve(held, 0, 1)
        self.slot_ids.drop(slot)

    def span(self, pages: list[int], stop: int):
        """Positions 0 … stop−1 (stop ≥ 1) of a page table in a `[pages · page_size, …]` view: a slice when
        the pages are consecutive, else an index tensor."""
        P = self.page_size
        run = pages[: (stop - 1) // P + 1]
        if run == list(range(run[0], run[0] + len(run))):
            return slice(run[0] * P, run[0] * P + stop)
        return page_rows(torch.tensor(run), torch.arange(stop), P)

    def prepare(self, seqs: list["SequenceState"], T: int, block_len: int, valid_lens=None,
                stepwise: bool = False) -> ForwardBatch:
        """Pages for T new tokens per row, fresh GDN slots where tokens are committed: the batch a forward
        runs on (`stepwise`: see ForwardBatch). Call `finish(batch, seqs)` after the forward (or `abort` if
        it failed)."""
        with self._lock:
            starts = [s.length for s in seqs]
            commits = [T - block_len] * len(seqs) if valid_lens is None else list(valid_lens)
            for s, start in zip(seqs, starts):
                if s.pool is not self:
                    raise ValueError("every sequence of one forward must come from the same state pool")
                self._grow(s._held, start + T)
                self._make_writable(s._held, start, start + T)
            write = None
            if self.has_gdn and any(commits):
                write = []
                try:
                    for s, n in zip(seqs, commits):
                        write.append(self._seq_take_slot(s._held) if n else None)
                except PoolFull:
                    for s, slot in zip(seqs, write):
                        self._seq_drop_slot(s._held, slot)
                    raise
            records = None
            if any(s._records is not None for s in seqs):
                records = [s._records for s in seqs]
            return ForwardBatch(self, starts, commits, block_len, [list(s._held.pages) for s in seqs],
                                [s._held.slot for s in seqs], write, records, padded=valid_lens is not None,
                                stepwise=stepwise)

    def finish(self, batch: ForwardBatch, seqs: list["SequenceState"]) -> None:
        with self._lock:
            for b, s in enumerate(seqs):
                s.length += batch.commits[b]
                if batch.write_slots is not None and batch.write_slots[b] is not None:
                    self._seq_set_slot(s._held, batch.write_slots[b], taken=True)

    def abort(self, batch: ForwardBatch, seqs: list["SequenceState"]) -> None:
        with self._lock:
            for s, slot in zip(seqs, batch.write_slots or ()):
                self._seq_drop_slot(s._held, slot)

    def stats(self) -> dict:
        with self._lock:
            return {"pages": self.num_pages, "free_pages": self.free_pages, "reserved_pages": self.reserved_pages,
                    "slots": self.num_slots, "free_slots": self.free_slots,
                    "reserved_slots": self.reserved_slots, "page_size": self.page_size, "bytes": self.nbytes(),
                    "page_bytes": self.bytes_per_page(self.config, self.dtype, self.page_size),
                    "slot_bytes": self.bytes_per_slot(self.config, self.dtype),
                    **self.prefix.stats()}


@dataclass
class CacheSnapshot:
    length: int
    slot: int


class SequenceState:
    """One sequence's place in the pool: its length, page table and GDN slot. It moves back by `snapshot` /
    `restore` (a slot reference and a length: K/V roll back by length), `truncate`, or an open speculation
    (`begin_speculation` / `rollback`: only the accepted GDN inputs re-run, no per-position state is stored)."""

    def __init__(self, pool: StatePool, held: _Holdings):
        self.pool = pool
        self._held = held
        self.length = 0
        self.spec_start: int | None = None
        # during a speculation, GDN layer index → the forwards it committed: (mixer, gdn_core, u, z, b, a)
        # each, u [T, C], z [T, ·], b, a [T, Hv], and the op that took them
        self._records: dict | None = None
        self._finalizer = weakref.finalize(self, pool._release, held)

    @property
    def pages(self) -> list[int]:
        return list(self._held.pages)

    @property
    def slot(self) -> int:
        return self._held.slot

    def release(self) -> None:
        """Give everything back to the pool now (also done when the handle is garbage-collected)."""
        self._finalizer()

    def gdn_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GDN layer `layer`'s conv tail [C, K−1] and recurrent state [Hv, dk, dv] (views into the pool:
        read them, do not write them)."""
        return self.pool.conv[layer][self._held.slot], self.pool.recurrent[layer][self._held.slot]

    def kv(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layer `layer`'s K and V of positions 0 … upto−1 (default: the length), [n, Hkv, D] copies."""
        n = self.length if upto is None else upto
        table = torch.tensor(self._held.pages[: self.pool.pages_for(n)], dtype=torch.long)
        rows = page_rows(table, torch.arange(n), self.pool.page_size)
        k, v = self.pool.k[layer], self.pool.v[layer]
        return k.view(-1, *k.shape[2:])[rows], v.view(-1, *v.shape[2:])[rows]

    def fork(self) -> "SequenceState":
        """An independent copy at the same length: the pages and the GDN slot are shared (a page is
        copied when either side writes into it; slots are never written), so forking costs no copy."""
        pool = self.pool
        if self.spec_start is not None:
            raise ValueError("cannot fork a sequence during a speculation")
        with pool._lock:
            twin = pool.new_sequence()
            for p in self._held.pages:
                pool.page_ids.ref(p)
            twin._held.pages = list(self._held.pages)
            pool._seq_set_slot(twin._held, self._held.slot)
            twin.length = self.length
            return twin

    def __deepcopy__(self, memo) -> "SequenceState":
        return self.fork()

    def snapshot(self) -> CacheSnapshot:
        with self.pool._lock:
            self.pool.slot_ids.ref(self._held.slot)
            self._held.snapshot_slots.append(self._held.slot)
            return CacheSnapshot(self.length, self._held.slot)

    def restore(self, snap: CacheSnapshot) -> None:
        if snap.length > self.length:
            raise ValueError(f"cannot restore a snapshot at {snap.length} into a cache of length {self.length}")
        if snap.slot not in self._held.snapshot_slots:
            raise ValueError("this snapshot was not taken from this sequence")
        with self.pool._lock:
            self.pool._seq_set_slot(self._held, snap.slot)
            self._close_speculation()
            self.length = snap.length

    def truncate(self, n: int) -> None:
        """Drop everything after position `n`. GDN layers need a speculation record covering it."""
        if n == self.length:
            return
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if self.pool.has_gdn and (self.spec_start is None or n < self.spec_start):
            raise ValueError(
                "GDN states cannot be truncated without a snapshot: call begin_speculation() before the "
                "tokens to be dropped, or restore() a snapshot"
            )
        if self.spec_start is not None:
            self.rollback(n)
            return
        self.length = n

    def begin_speculation(self) -> None:
        """Mark the current length as a rollback point and start recording GDN inputs."""
        with self.pool._lock:
            self._close_speculation()
            self.spec_start = self.length
            self.pool.slot_ids.ref(self._held.slot)
            self._held.saved_slot = self._held.slot
            self._records = {i: [] for i in self.pool.conv} if self.pool.has_gdn else None

    def _close_speculation(self) -> None:
        self.spec_start = None
        self._records = None
        self.pool._seq_drop_slot(self._held, self._held.saved_slot)
        self._held.saved_slot = None

    def rollback(self, n: int) -> None:
        """Keep positions `< n` (n ≥ the speculation start). GDN layers replay the accepted tokens from the
        kept slot through the op that took them: bit for bit the state one autoregressive step per token
        makes (the kernels' causal passes do not depend on how tokens are grouped into calls)."""
        start = self.spec_start
        if start is None or not start <= n <= self.length:
            raise ValueError(f"rollback to {n} needs an open speculation starting at or before it (start {start})")
        pool, held = self.pool, self._held
        keep = n - start
        with pool._lock:
            if pool.has_gdn and n != self.length:
                if keep == 0:
                    pool._seq_set_slot(held, held.saved_slot)
                else:
                    target = held.slot
                    if pool.slot_ids.refs[target] > 1 or target in (held.saved_slot, 0):
                        target = pool._seq_take_slot(held)
                    replay = ForwardBatch(self.pool, [start], [keep], 0, [list(held.pages)], [held.saved_slot],
                                          [target], None)
                    for forwards in self._records.values():
                        mixer, gdn_core = forwards[0][:2]
                        u, z, b, a = (torch.cat(parts)[None, :keep] for parts in list(zip(*forwards))[2:])
                        gdn_core(mixer, u, z, b, a, replay, 0)        # (the output is not needed)
                    if target != held.slot:
                        pool._seq_set_slot(held, target, taken=True)
            self.length = n
            self._close_speculation()


def logits_rows(logits_at, block_len: int, batch, device):
    """What picks, from a forward's [B, T, ·] hidden states, the rows `logits_at` asks for ("all",
    "last", "block", or a bool mask [B, L] over the block's positions: those rows, [N, ·])."""
    if torch.is_tensor(logits_at):                     # only the positions that will be read
        L = logits_at.shape[1]                         # (their indices found on the mask's device, the host's)
        picked = to_device(logits_at.reshape(-1).nonzero().squeeze(1), device)
        return lambda t: t[:, t.shape[1] - L:].reshape(-1, t.shape[-1])[picked]
    if logits_at == "last":
        if batch is not None and batch.padded:         # right-padded rows: each row's own last token
            last = device_tensor(batch.commits, device) - 1
            return lambda t: t[torch.arange(t.shape[0], device=t.device), last][:, None]
        return lambda t: t[:, -1:]
    if logits_at == "block":
        return lambda t: t[:, t.shape[1] - block_len:]
    return lambda t: t
