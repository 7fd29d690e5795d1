"""bf16 weights packed for the native kernels (layers/packed.py) compute what the plain model computes."""

import copy

import pytest
import torch

from clover.layers.packed import pack_for_cpu, packing_available
from tiny_models import make_model

pytestmark = pytest.mark.skipif(not packing_available(), reason="no CPU weight packing backend here")


@pytest.mark.parametrize("variant", ["base", "tied_gqa4"])
def test_packed_model_matches_plain_model(variant, monkeypatch):
    # kernels/attention_cached.c computes attention in fp32 for any number of queries; PyTorch's CPU
    # kernel rounds the probabilities to bf16 below FP32_ATTENTION_MIN_QUERIES. With that rounding
    # the plain model flips one near-tie decision of the batched block generation below (position
    # 10 of the first prompt: 15 vs 38, checked); the plain model computing attention in fp32 too
    # decides as the kernels do, so that is the reference here.
    import clover.layers.attention as attention

    monkeypatch.setattr(attention, "FP32_ATTENTION_MIN_QUERIES", 1)
    plain = make_model(variant, seed=4, dtype=torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_for_cpu(packed) > 0
    assert packed.model.layers[0].mlp.experts.gate_up_proj is None          # originals freed
    fused = [m for m in packed.modules() if getattr(m, "input_projections", None)]
    assert len(fused) == 2 * plain.config.num_hidden_layers                  # mixer + MoE per layer
    for m in fused:                       # one stacked matrix replaces the maps that read the same input
        assert m.fused_input is not None
        for name in m.input_projections:
            parent, _, leaf = name.rpartition(".")
            assert not hasattr(m.get_submodule(parent) if parent else m, leaf)
    exact = copy.deepcopy(plain).to(torch.float32)          # the same bf16 weights, computed in fp32

    def close(got, want, ref):
        """The native kernels sum in another order and run the GDN token by token, so the packed model's
        error against the fp32 computation must stay that of the plain bf16 model (within 2×)."""
        scale = ref.abs().max()
        return (got.float() - ref).abs().max() <= 2 * (want.float() - ref).abs().max() + 1e-3 * scale

    ids = torch.randint(6, 90, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = plain(ids), packed(ids)
        assert close(b, a, exact(ids))
        # Same greedy choices (here and in the generations below). For the kernels this holds on these
        # seeds because no position is a near-tie; a change of rounding that flips one should show
        # here and be judged against `exact` (a near-tie) rather than accepted blindly.
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        # cached decode and block steps go through the same packed weights (and kernels/gdn_short.c)
        ca, cb, ce = plain.make_cache(), packed.make_cache(), exact.make_cache()
        for model, cache in ((plain, ca), (packed, cb), (exact, ce)):
            model.step(ids[:1], [cache])
        blk = torch.full((1, 8), 95)
        x, y = plain.step(blk, [ca], block=True), packed.step(blk, [cb], block=True)
        assert close(y, x, exact.step(blk, [ce], block=True))
        out_a = plain.generate(ids[0, :12].tolist(), max_new_tokens=8, block_size=1)
        out_b = packed.generate(ids[0, :12].tolist(), max_new_tokens=8, block_size=1)
        assert out_a == out_b
        # several prompts decoded together (batched cached steps: block mode, commits, AR rows)
        prompts = [ids[0, :9].tolist(), ids[1, :15].tolist(), ids[0, 20:31].tolist()]
        for kw in ({"block_size": 8, "threshold": 0.5}, {"block_size": 1},
                   {"block_size": 8, "decoding": "self_speculative"}):   # speculation: GDN records + rollback
            want = plain.generate(prompts, max_new_tokens=16, **kw)
            got = packed.generate(prompts, max_new_tokens=16, **kw)
            assert got == want


def test_packing_skips_float32_models():
    model = make_model("base", dtype=torch.float32)
    assert pack_for_cpu(model) == 0
    assert model.model.layers[0].mlp.experts.gate_up_proj is not None


def test_saving_a_packed_model_is_refused(tmp_path):
    """A packed model's matrices live outside its state dict; saving it would write a checkpoint
    missing them, so it is an error naming the problem."""
    from clover.checkpoint import save_checkpoint

    model = make_model("base", dtype=torch.bfloat16)
    pack_for_cpu(model)
    with pytest.raises(ValueError, match="packed for CPU inference"):
        save_checkpoint(model, model.config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not packing_available(), reason="native kernels unavailable")
def test_packed_weights_are_registered_state():
    """Packing is a weight transform whose tensors are registered buffers: `state_dict()` lists them,
    `load_state_dict()` of another packed model's weights makes this one compute exactly what that one
    does (the kernels' cached fp32 constants follow the reload), and `.to()` / casts raise before
    touching anything instead of silently doing nothing."""
    a, b = make_model("base", seed=1, dtype=torch.bfloat16), make_model("base", seed=2, dtype=torch.bfloat16)
    for m in (a, b):
        assert pack_for_cpu(m) > 0
    keys = a.state_dict().keys()
    assert any(k.endswith("fused_input.weight_packed_panels") for k in keys)
    assert any(k.endswith("gate_up_panels") for k in keys)
    ids = torch.randint(5, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = a(ids)
        with torch.no_grad():                                           # a warm cache of kernel constants
            c = a.make_cache()
            a.step(ids[:1], [c])
    with pytest.raises(RuntimeError, match="repacked for Clover's CPU kernels"):
        a.float()
    with pytest.raises(RuntimeError, match="cannot be moved"):
        a.to("meta")
    a.load_state_dict({k: v.clone() for k, v in b.state_dict().items()})
    with torch.inference_mode():
        assert torch.equal(a(ids), b(ids)) and not torch.equal(a(ids), before)
        ca, cb = a.make_cache(), b.make_cache()
        assert torch.equal(a.step(ids[:1], [ca]), b.step(ids[:1], [cb]))              # GDN / attention kernels
        block = torch.full((1, 8), a.config.mask_token_id)
        assert torch.equal(a.step(block, [ca], block=True), b.step(block, [cb], block=True))


@pytest.mark.skipif(not packing_available(), reason="native kernels unavailable")
def test_a_model_built_under_inference_mode_runs_the_kernels():
    """Parameters created under `torch.inference_mode` are inference tensors, which keep no version
    counter: the kernels' cached constants must not depend on one there (the fast path equals the same
    weights built outside inference mode)."""
    outside = make_model("base", seed=3, dtype=torch.bfloat16)
    pack_for_cpu(outside)
    with torch.inference_mode():
        inside = make_model("base", seed=3, dtype=torch.bfloat16)
        pack_for_cpu(inside)
        ids = torch.randint(5, 90, (1, 30), generator=torch.Generator().manual_seed(1))
        assert torch.equal(inside(ids), outside(ids))
        a, b = inside.make_cache(), outside.make_cache()
        assert torch.equal(inside.step(ids, [a]), outside.step(ids, [b]))


@pytest.mark.parametrize("variant,bits", [("base", None), ("tied_gqa4", None), ("base", 4), ("base", 8)])
def test_loading_packs_each_part_as_it_is_filled(tmp_path, variant, bits):
    """`clover.load` packs each layer as soon as it is read, the tensors packing replaces read into one
    scratch every layer reuses (checkpoint.PartScratch): the model must equal one read whole and packed
    afterwards, bit for bit, in bf16 and quantized checkpoints, tied and untied."""
    import clover
    from clover.checkpoint import load_model, save_checkpoint
    from clover.quantization.convert import quantize_checkpoint

    model = make_model(variant, dtype=torch.bfloat16)
    path = tmp_path / "bf16"
    save_checkpoint(model, model.config, path)
    if bits is not None:
        path = quantize_checkpoint(path, tmp_path / f"int{bits}", bits=bits, progress=False)
    loaded = clover.load(path)
    whole = load_model(path, dtype=torch.bfloat16, table_in_file=True)
    pack_for_cpu(whole)
    assert loaded.packed == whole.packed == "clover-kernels"
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), whole(ids))
