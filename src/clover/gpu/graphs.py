"""CUDA graphs of the short cached forwards (decode steps, block steps, fused commits), per batch bucket; what
they cover and their limits: docs/gpu.md ("CUDA graphs"). A graph replays fixed kernels on fixed addresses, so
each runs on static buffers: rows padded to a bucket (a padding row reads slot 0, the zero GDN state, and writes
only this runner's scratch pages and slot), keys over a power-of-two window masked at each row's own end, one
copy of the step's index to the device. `replay="eager"` runs the same forwards uncaptured (the CPU tests).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..cache import BatchIndex, ForwardBatch, logits_rows
from ..transfer import device_tensor

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WINDOW = 256
MAX_TOKENS = 64          # tokens per row a graph covers: decode, block steps and fused commits of blocks ≤ 32
MAX_GRAPHS = 64          # captured graphs kept (least recently used dropped first) …
MAX_GRAPHS_BYTES = 2 << 30  # … and their static outputs' bytes, together
# a graph's logits are static memory of their own (a block step's [rows, 32, 248k] bf16: 16 MB a row)
MAX_GRAPH_LOGITS_BYTES = 256 << 20


def batch_bucket(rows: int) -> int | None:
    """The smallest bucket that holds `rows` rows, or None when there are more than the largest."""
    return next((b for b in BATCH_BUCKETS if b >= rows), None)


def key_window(end: int, page_size: int) -> int:
    """Keys a graph gathers per row for rows ending at most at `end`: a power of two ≥ MIN_WINDOW,
    whole pages."""
    window = max(MIN_WINDOW, 1 << (end - 1).bit_length())
    return -(-window // page_size) * page_size


@dataclass(frozen=True)
class GraphKey:
    rows: int
    tokens: int
    block_len: int
    window: int
    selection: bool          # block expert selection on (a [rows] block_top_p input)
    logits: str              # "last" or "block": which positions go through the vocabulary projection
    stats: bool              # the block's distinct experts per MoE layer are outputs too


class _StaticForward:
    """One graph's static inputs, its forward over them, and (once captured) its outputs."""

    def __init__(self, runner: "StepGraphs", key: GraphKey):
        self.runner, self.key = runner, key
        pool, device = runner.pool, runner.device
        B, T = key.rows, key.tokens
        self.pages = key.window // pool.page_size
        with torch.inference_mode(False):       # plain tensors (as the pool's): filled in and out of inference mode
            # one int64 buffer for everything the host decides each step: [starts, read slots, write slots, page table]
            self.flat = torch.zeros(B * (3 + self.pages), dtype=torch.long, device=device)
            self.ids = torch.zeros(B, T, dtype=torch.long, device=device)
            self.top_p = torch.ones(B, dtype=torch.float32, device=device) if key.selection else None
        commits = T - key.block_len
        self.batch = ForwardBatch(pool, starts=[0] * B, commits=[commits] * B, block_len=key.block_len,
                                  pages=[[]] * B, read_slots=[0] * B,
                                  write_slots=[runner.scratch_slot] * B if commits and pool.has_gdn else None,
                                  records=None)
        self.outputs = None
        self.graph = None

    def fill(self, ids, batch: ForwardBatch | None, top_p) -> None:
        """Copy one step's rows into the static inputs; rows past the batch (and all rows when `batch`
        is None: before capture) are padding."""
        key, runner = self.key, self.runner
        B, T, W = key.rows, key.tokens, self.pages
        n = 0 if batch is None else len(batch.starts)
        P = runner.pool.page_size
        pad_pages = runner.scratch_pages
        starts = [0] * B
        reads = [0] * B
        writes = [runner.scratch_slot] * B
        table = []
        for b in range(B):
            if b < n:
                starts[b] = batch.starts[b]
                reads[b] = batch.read_slots[b]
                if batch.write_slots is not None and batch.write_slots[b] is not None:
                    writes[b] = batch.write_slots[b]
                pages = batch.pages[b][:-(-(starts[b] + T) // P)]
            else:
                pages = pad_pages
            table.extend(pages)
            table.extend([pages[-1]] * (W - len(pages)))
        self.flat.copy_(device_tensor(starts + reads + writes + table, self.flat.device, torch.long))
        if n:
            self.ids[:n].copy_(ids)
        self.ids[n:].fill_(0)
        if self.top_p is not None:
            self.top_p.fill_(1.0)
            if n and top_p is not None:
                self.top_p[:n].copy_(top_p)

    def index(self) -> BatchIndex:
        """The forward's `BatchIndex`, computed on the device from the static inputs (inside the graph)."""
        key, pool = self.key, self.runner.pool
        B, T, W, P = key.rows, key.tokens, self.pages, pool.page_size
        device = self.flat.device
        starts, reads, writes, table = torch.split(self.flat, [B, B, B, B * W])
        commits = T - key.block_len
        write_rows = torch.arange(B if commits and pool.has_gdn else 0, device=device)
        write_slots = writes if commits and pool.has_gdn else writes[:0]
        return BatchIndex(reads, write_rows, write_slots, starts, table.view(B, W), tokens=T, key_len=W * P,
                          page_size=P, uniform=False)

    def forward(self):
        """The captured work: index, positions, the model's forward; (logits, per-layer distinct experts)."""
        key = self.key
        idx = self.index()
        self.batch._index = {(self.flat.device, key.tokens): idx}
        positions = idx.starts[:, None] + torch.arange(key.tokens, device=self.flat.device)
        stats = [] if key.stats else None
        logits = self.runner.model.run(self.ids, positions, self.batch, key.block_len, self.top_p, key.logits,
                                        stats)
        return logits, stats

    def capture(self) -> None:
        self.fill(None, None, None)                     # all padding: warm-up and capture touch scratch only
        if self.runner.replay == "eager":
            self.outputs = self.forward()
            return
        stream = torch.cuda.Stream(self.flat.device)
        stream.wait_stream(torch.cuda.current_stream(self.flat.device))
        with torch.cuda.stream(stream):                 # warm-up (Triton autotuning, cuBLAS workspaces)
            self.forward()
        torch.cuda.current_stream(self.flat.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.runner.memory_pool is None:
            self.runner.memory_pool = torch.cuda.graph_pool_handle()
        # thread-local: the server's other threads may touch CUDA while the engine thread captures
        with torch.cuda.graph(graph, pool=self.runner.memory_pool, capture_error_mode="thread_local"):
            self.outputs = self.forward()
        self.graph = graph

    def nbytes(self) -> int:
        logits, stats = self.outputs
        tensors = [self.flat, self.ids, logits] + list(stats or []) + ([self.top_p] if self.top_p is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        self.outputs = self.forward()                   # eager replay: same buffers, run again
        return self.outputs


class StepGraphs:
    """The graphs of one model over one state pool (a new pool — new addresses — needs a new runner)."""

    def __init__(self, model, pool, replay: str = "cuda"):
        self.model, self.pool, self.replay = model, pool, replay
        self.device = next(iter({**pool.k, **pool.conv}.values())).device
        self.graphs: OrderedDict[GraphKey, _StaticForward] = OrderedDict()
        self.failed: set[GraphKey] = set()
        self.memory_pool = None      # one CUDA memory pool for all graphs, made at the first capture
        self.scratch_pages, self.scratch_slot = pool.take_scratch(MAX_TOKENS)

    def nbytes(self) -> int:
        """Bytes of the kept graphs' static inputs and outputs (their logits, mostly)."""
        return sum(g.nbytes() for g in self.graphs.values())

    def close(self) -> None:
        """Give the scratch pages and slot back to the pool and drop the graphs."""
        self.pool.give_back_scratch(self.scratch_pages, self.scratch_slot)
        self.scratch_pages = []
        self.graphs.clear()

    def key_for(self, ids, batch: ForwardBatch, block_len: int, block_top_p, logits_at, stats) -> GraphKey | None:
        """The graph that runs this forward, or None when graphs do not cover it."""
        B, T = ids.shape
        rows = batch_bucket(B)
        if (rows is None or T > MAX_TOKENS or batch.padded or batch.records is not None
                or ids.device != self.device):
            return None
        if torch.is_tensor(logits_at) or logits_at == "block":
            if not block_len:
                return None
            kind = "block"
        elif logits_at in ("last", "all") and T == 1 and not block_len:
            kind = "last"
        elif logits_at == "all" and block_len == T:
            kind = "block"
        else:
            return None
        window = key_window(max(batch.starts) + T, self.pool.page_size)
        if window > self.pool.num_pages * self.pool.page_size:
            return None
        positions = 1 if kind == "last" else block_len
        logits_bytes = rows * positions * self.model.config.vocab_size * self.model.dtype.itemsize
        if logits_bytes > MAX_GRAPH_LOGITS_BYTES:
            return None
        return GraphKey(rows, T, block_len, window, block_top_p is not None, kind, stats is not None)

    def run(self, ids, batch: ForwardBatch, block_len: int, block_top_p, logits_at, stats):
        """This forward's logits through a graph (capturing it first if new), or None when it runs eagerly."""
        key = self.key_for(ids, batch, block_len, block_top_p, logits_at, stats)
        if key is None or key in self.failed:
            return None
        with torch.inference_mode():
            outputs = self._replay(key, ids, batch, block_top_p)
        if outputs is None:
            return None
        logits, layer_stats = outputs              # static: copied out (outside inference mode when the caller is)
        n = ids.shape[0]
        if stats is not None:
            stats.extend(s[:n].clone() for s in layer_stats)
        if torch.is_tensor(logits_at):                 # the positions that will be read, chosen on the host
            return logits_rows(logits_at, block_len, batch, logits.device)(logits[:n])
        return logits[:n].clone()

    def _replay(self, key: GraphKey, ids, batch: ForwardBatch, block_top_p):
        graph = self.graphs.get(key)
        if graph is None:
            graph = _StaticForward(self, key)
            try:
                graph.capture()
            except Exception as exc:                   # e.g. an op that reads back to the host
                self.failed.add(key)
                log.warning("CUDA graph capture failed for %s (%s: %s); that forward runs eagerly", key,
                            type(exc).__name__, exc)
                return None
            self.graphs[key] = graph
            while len(self.graphs) > 1 and (len(self.graphs) > MAX_GRAPHS or self.nbytes() > MAX_GRAPHS_BYTES):
                self.graphs.popitem(last=False)      # least recently used first (the new one is last)
        self.graphs.move_to_end(key)
        graph.fill(ids, batch, block_top_p)
        return graph.replay()
