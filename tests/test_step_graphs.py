"""Step graphs (clover/gpu/graphs.py): decode steps, block steps and fused commits run on static buffers
(rows padded to a bucket, keys over a fixed window, padding rows on scratch state). On CPU the runner
replays eagerly — the same static-buffer forward, run again — so everything but the CUDA capture is
checked here against the same model without graphs; the capture itself is a `gpu` test."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode

from clover.backend import Backend
from clover.gpu import graphs
from clover.quantization import QuantSpec, quantize_model
from tiny_models import make_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pair(dtype=torch.float32, replay="eager", device="cpu", quantized=False):
    eager = make_model("base", seed=0, dtype=dtype).to(device)
    if quantized:
        quantize_model(eager, QuantSpec(4, 16))
    eager.backend = Backend("cuda")
    graphed = copy.deepcopy(eager)
    graphed.runner.use_graphs(replay)
    return eager, graphed


def _runner(model):
    return model.runner._graphs


def _close(a, b, dtype=torch.float32):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert a.shape == b.shape
    a, b = a.float().cpu(), b.float().cpu()
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max()


def _forwards(model, prompts, device="cpu"):
    """Every forward kind the decoder graphs, on 3 rows of different lengths (a 4-row bucket), decode
    steps carrying the longest row across the 256-key window; returns each forward's outputs and the
    rows' final caches."""
    mask = model.config.mask_token_id
    out = []
    with torch.inference_mode():
        caches = [model.make_cache() for _ in prompts]
        model.prefill_batch(prompts, caches)
        block = torch.full((3, 8), mask, device=device)
        block[:, 2] = 7
        wanted = block.cpu() == mask
        stats: list = []
        out.append(model.step(block, caches, block=True, block_top_p=[1.0, 0.7, 0.5], logits_at=wanted,
                              stats=stats))
        out.extend(stats)
        stats = []
        out.append(model.step(block, caches, block=True, logits_at="block", stats=stats))   # selection off
        out.extend(stats)
        for t in range(12):                                                  # decode: 245 → 257 tokens
            out.append(model.step(torch.tensor([[5 + t], [6], [7]], device=device), caches, logits_at="last"))
        fused = torch.cat([torch.randint(0, 90, (3, 8), generator=torch.Generator().manual_seed(4)).to(device),
                           torch.full((3, 8), mask, device=device)], 1)
        stats = []
        out.append(model.step(fused, caches, block_len=8, block_top_p=0.9, logits_at="block", stats=stats))
        out.extend(stats)
        out.append(model.step(torch.tensor([[9], [10], [11]], device=device), caches))      # "all", one token
    return out, caches


PROMPTS = [list(range(3, 40)), [(7 * i) % 90 for i in range(245)], [11, 12, 13, 14, 15]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_forwards_match_eager_ones(dtype, attention_path):
    eager, graphed = _pair(dtype)
    a, caches_a = _forwards(eager, PROMPTS)
    b, caches_b = _forwards(graphed, PROMPTS)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x.dtype != torch.long:
            _close(x, y, dtype)
        elif dtype == torch.float32:                       # distinct experts: exact in fp32
            assert torch.equal(x, y)
        else:                                              # (a bf16 near-tie in routing may move one)
            assert (x - y).abs().max() <= 1
    # what the rows cached (K/V of every position, GDN state) is what the eager forwards cached
    for ca, cb in zip(caches_a, caches_b):
        assert ca.length == cb.length
        for layer, kind in enumerate(eager.config.layer_types):
            if kind == "linear_attention":
                for sa, sb in zip(ca.gdn_state(layer), cb.gdn_state(layer)):
                    _close(sa, sb, dtype)
            else:
                for sa, sb in zip(ca.kv(layer), cb.kv(layer)):
                    _close(sa, sb, dtype)
    runner = _runner(graphed)
    kinds = {(k.rows, k.tokens, k.block_len, k.window, k.selection, k.logits) for k in runner.graphs}
    assert {(4, 8, 8, 256, True, "block"), (4, 8, 8, 256, False, "block"), (4, 1, 0, 256, False, "last"),
            (4, 1, 0, 512, False, "last"), (4, 16, 8, 512, True, "block")} <= kinds
    assert not runner.failed


def test_padding_rows_touch_only_the_scratch_state():
    """A 3-row step runs as 4 rows; the fourth reads the zero state and writes scratch pages and the
    scratch slot, which no sequence ever holds — an idle sequence's state is unchanged."""
    _, model = _pair()
    with torch.inference_mode():
        idle = model.make_cache()
        model.prefill_batch([[5, 6, 7, 8, 9, 10]], [idle])
        pool = model.runner.state_pool()
        before = {layer: [t.clone() for t in (idle.gdn_state(layer) if kind == "linear_attention" else idle.kv(layer))]
                  for layer, kind in enumerate(model.config.layer_types)}
        zero = [pool.conv[0][0].clone(), pool.recurrent[0][0].clone()]
        caches = [model.make_cache() for _ in range(3)]
        model.prefill_batch([[1, 2, 3], [4, 5, 6, 7], [8]], caches)
        for t in range(3):
            model.step(torch.tensor([[t + 20]] * 3), caches)
            model.step(torch.full((3, 8), model.config.mask_token_id), caches, block=True)
        runner = _runner(model)
        assert runner.graphs and all(k.rows == 4 for k in runner.graphs)
        for c in caches + [idle]:
            assert not set(c.pages) & set(runner.scratch_pages)
            assert c.slot != runner.scratch_slot
        for layer, kind in enumerate(model.config.layer_types):
            now = idle.gdn_state(layer) if kind == "linear_attention" else idle.kv(layer)
            for x, y in zip(before[layer], now):
                assert torch.equal(x, y)
        assert torch.equal(zero[0], pool.conv[0][0]) and torch.equal(zero[1], pool.recurrent[0][0])


def test_the_runner_holds_its_scratch_state_until_turned_off():
    _, model = _pair()
    pool = model.runner.state_pool()
    pages, slots = pool.free_pages, pool.free_slots
    with torch.inference_mode():
        c = model.make_cache()
        model.prefill_batch([[3, 4, 5]], [c])
        model.step(torch.tensor([[6]]), [c])
        c.release()
    runner = _runner(model)
    assert pool.free_pages == pages - len(runner.scratch_pages) and pool.free_slots == slots - 1
    model.runner.use_graphs(None)
    assert pool.free_pages == pages and pool.free_slots == slots
    assert model.runner._graphs is None and model.runner.graph_replay is None


def test_generation_with_graphs_equals_generation_without():
    eager, graphed = _pair()
    prompts = [[5, 9, 13, 2 + i] * (i + 1) for i in range(3)]
    for kw in (dict(block_size=8, threshold=0.5, block_expert_top_p=0.7), dict(block_size=1),
               dict(decoding="self_speculative", block_size=4, draft_steps=1)):
        a = eager.generate(prompts, max_new_tokens=20, eos_token_id=[], **kw)
        b = graphed.generate(prompts, max_new_tokens=20, eos_token_id=[], **kw)
        assert a == b if isinstance(a, list) else torch.equal(a, b), kw


def test_forwards_the_graphs_do_not_cover_run_eagerly():
    _, model = _pair()
    with torch.inference_mode():
        caches = [model.make_cache() for _ in range(2)]
        model.prefill_batch([[3, 4, 5], [6, 7]], caches)             # right-padded prefill: eager
        model.step(torch.arange(70).view(1, 70).expand(2, 70) % 90, caches)   # 70 tokens a row: eager
        runner = _runner(model)
        assert not runner.graphs
        model.step(torch.tensor([[5], [6]]), caches, logits_at="none")   # a commit nobody reads: eager
        assert not runner.graphs
    assert graphs.batch_bucket(3) == 4 and graphs.batch_bucket(257) is None
    assert graphs.key_window(5, 32) == 256 and graphs.key_window(256, 32) == 256 and graphs.key_window(257, 32) == 512


def test_a_failed_capture_falls_back_to_the_eager_forward(monkeypatch, caplog):
    eager, graphed = _pair()

    def refuse(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs._StaticForward, "capture", refuse)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="clover.gpu.graphs"):
        outs = []
        for model in (eager, graphed):
            c = model.make_cache()
            model.prefill_batch([[3, 4, 5, 6]], [c])
            outs.append([model.step(torch.tensor([[7 + t]]), [c]) for t in range(2)])
    for x, y in zip(*outs):
        assert torch.equal(x, y)
    runner = _runner(graphed)
    assert len(runner.failed) == 1 and not runner.graphs
    assert sum("capture failed" in r.message for r in caplog.records) == 1      # once per key


def test_a_full_pool_turns_the_graphs_off_for_it(caplog):
    _, model = _pair()
    pool = model.runner.configure_pool(memory_bytes=None, max_sequences=1)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="clover.gpu.graphs"):
        held = [pool.new_sequence(reserve_tokens=(pool.available_pages() - 1) * pool.page_size)]
        c = held[0]
        model.prefill_batch([[3, 4, 5]], [c])
        model.step(torch.tensor([[6]]), [c])
    assert model.runner._graphs is False
    assert any("no room" in r.message for r in caplog.records)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_cuda_graphs_replay_what_the_eager_forwards_compute(quantized):
    """Quantized weights too: their experts dequantize inside the captured graphs."""
    eager, graphed = _pair(torch.bfloat16, replay="cuda", device="cuda", quantized=quantized)
    a, _ = _forwards(eager, PROMPTS, device="cuda")
    b, _ = _forwards(graphed, PROMPTS, device="cuda")
    for x, y in zip(a, b):
        if x.dtype == torch.long:
            assert torch.equal(x, y)
        else:
            _close(x, y, torch.bfloat16)
    runner = _runner(graphed)
    assert runner.graphs and not runner.failed and all(g.graph is not None for g in runner.graphs.values())


def test_outputs_belong_to_the_caller():
    """Logits and stats are copies: the next replay does not overwrite them, and a caller outside
    inference mode gets ordinary tensors it may change in place."""
    _, model = _pair()
    c = model.make_cache()
    with torch.inference_mode():
        model.prefill_batch([[3, 4, 5]], [c])
        first = model.step(torch.tensor([[6]]), [c])
    kept = first.clone()
    with torch.no_grad():
        second = model.step(torch.tensor([[7]]), [c])
        stats: list = []
        block = model.step(torch.full((1, 8), model.config.mask_token_id), [c], block=True,
                           logits_at=torch.ones(1, 8, dtype=torch.bool), stats=stats)
    assert torch.equal(first, kept) and not torch.equal(first, second)
    for t in (second, block, stats[0]):
        assert not t.is_inference()
        t.add_(1)


def test_load_turns_graphs_on_only_on_a_cuda_device():
    import clover

    assert clover.load(backend="cuda").runner.graph_replay is None          # the cuda backend on the CPU: eager


@pytest.mark.gpu
@needs_cuda
def test_load_on_cuda_turns_graphs_on_unless_asked_not_to(monkeypatch, setenv):
    import clover

    assert clover.load(device="cuda").runner.graph_replay == "cuda"
    assert clover.load(device="cuda", cuda_graphs=False).runner.graph_replay is None
    setenv("CLOVER_CUDA_GRAPHS", "0")
    assert clover.load(device="cuda").runner.graph_replay is None


class HostReads(TorchFunctionMode):
    """Records the tensor operations that read device values on the host, or size their output by
    them (on a GPU each is a synchronisation, which a CUDA graph capture refuses), and host data
    turned into tensors (a host-to-device copy, refused too)."""

    SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero",
               "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "tensor"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.SYNCING or (name == "as_tensor" and not torch.is_tensor(args[0])):   # (of a tensor: itself)
            self.seen.append(name)
        elif name in ("__getitem__", "__setitem__", "index_put_") and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in _flat(args[1:2])):
            self.seen.append(f"{name} with a bool mask")
        elif name == "repeat_interleave" and torch.is_tensor(args[1] if len(args) > 1 else kwargs.get("repeats")) \
                and kwargs.get("output_size") is None:
            self.seen.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


def _flat(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flat(item)
        else:
            yield item


def test_the_host_read_guard_sees_what_it_looks_for():
    x = torch.arange(6.0)
    with HostReads() as guard:
        int(x.max()), bool(x.any()), x.tolist(), x[x > 2], x.nonzero(), torch.tensor([1])
        x[x > 4] = 0.0
        x[torch.tensor([1, 2])] + x.sum() * 2                      # none of these but the index's data
        torch.as_tensor(x), torch.as_tensor([3.0])                 # a tensor as itself: not seen
    assert guard.seen == ["__int__", "__bool__", "tolist", "__getitem__ with a bool mask", "nonzero", "tensor",
                          "__setitem__ with a bool mask", "tensor", "as_tensor"]


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
@pytest.mark.parametrize("kind", ["decode", "decode_one_row", "block", "commit"])
def test_the_graphed_forward_never_reads_the_device_on_the_host(kind, quantized, attention_path):
    """What a CUDA graph captures — the index computed from the static buffers, then the forward —
    makes no host read, no data-sized output and no host-to-device copy (each would end a capture),
    checked op by op on CPU; and it traces whole with torch.compile(fullgraph=True), equal to eager.
    Quantized weights too: a 4-row bucket routes 8 slots to 8 experts, so it dequantizes all experts;
    a 1-row decode (2 slots) runs the per-slot path."""
    _, model = _pair(torch.bfloat16, quantized=quantized)
    mask = model.config.mask_token_id
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]][:1 if kind == "decode_one_row" else 3]
    with torch.inference_mode():
        caches = [model.make_cache() for _ in prompts]
        model.prefill_batch(prompts, caches)
        if kind.startswith("decode"):
            model.step(torch.tensor([[3], [4], [5]][:len(prompts)]), caches)
        elif kind == "block":
            model.step(torch.full((3, 8), mask), caches, block=True, block_top_p=[0.7, 0.9, 1.0], stats=[])
        else:
            ids = torch.cat([torch.tensor([[7, 8, 9, 10]] * 3), torch.full((3, 4), mask)], 1)
            model.step(ids, caches, block_len=4, block_top_p=0.9, logits_at="block", stats=[])
        (graph,) = _runner(model).graphs.values()
        with HostReads() as guard:
            logits_e, stats_e = graph.forward()
        assert guard.seen == []
        torch._dynamo.reset()
        compiled = torch.compile(graph.forward, fullgraph=True, dynamic=False, backend="aot_eager")
        logits_c, stats_c = compiled()
    assert torch.equal(logits_c, logits_e)
    assert (stats_c is None) == (stats_e is None) and all(torch.equal(a, b) for a, b in zip(stats_c or [], stats_e or []))


def test_graph_memory_stays_within_its_budgets(monkeypatch):
    """Forwards whose static logits would pass MAX_GRAPH_LOGITS_BYTES run eagerly; past
    MAX_GRAPHS_BYTES the least recently used graphs are dropped; results stay those of the eager model."""
    eager, model = _pair()
    V = model.config.vocab_size
    one_row_block = 8 * V * 4                                    # a 1-row, 8-position fp32 block's logits
    monkeypatch.setattr(graphs, "MAX_GRAPH_LOGITS_BYTES", one_row_block)
    budget = one_row_block + 1000          # the block graph with its inputs, not with the decode graphs too
    monkeypatch.setattr(graphs, "MAX_GRAPHS_BYTES", budget)
    captured, capture = [], graphs._StaticForward.capture
    monkeypatch.setattr(graphs._StaticForward, "capture", lambda self: captured.append(self.key) or capture(self))
    mask = model.config.mask_token_id
    outs = []
    with torch.inference_mode():
        for m in (eager, model):
            got = []
            caches = [m.make_cache() for _ in range(2)]
            m.prefill_batch([[3, 4, 5, 6], [7, 8, 9]], caches)
            got.append(m.step(torch.full((2, 8), mask), caches, block=True, logits_at="block"))     # 2 rows: eager
            got.append(m.step(torch.full((1, 8), mask), caches[:1], block=True, logits_at="block"))  # 1 row: graphed
            for t in range(3):
                got.append(m.step(torch.tensor([[t + 10], [t + 20]]), caches))                      # decode: graphed
                got.append(m.step(torch.tensor([[t + 30]]), caches[:1]))
            outs.append(got)
    for a, b in zip(*outs):
        _close(a, b)
    runner = _runner(model)
    assert {(k.rows, k.tokens) for k in captured} == {(1, 8), (2, 1), (1, 1)}     # not the 2-row block
    assert runner.nbytes() <= budget
    assert GraphKey_with(runner, rows=1, tokens=1) and not GraphKey_with(runner, rows=1, tokens=8)  # the block was dropped


def GraphKey_with(runner, **fields):
    return [k for k in runner.graphs if all(getattr(k, f) == v for f, v in fields.items())]
