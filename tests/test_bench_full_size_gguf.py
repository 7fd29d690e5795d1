"""benchmarks.full_size_gguf: the Q4_K_M file it writes, at a small shape of the same architecture — llama.cpp's
type rules, weights with N(0, 0.02)'s mean and spread by `gguf`'s own dequantizer, loadable by Clover."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from benchmarks import full_size, full_size_gguf  # noqa: E402


def small_config(layers: int = 4) -> dict:
    """full_size's configuration with every matrix cut to whole 256-blocks (the K-quants' block)."""
    config = full_size.full_config(layers)
    del config["quantization_config"]
    config.update(hidden_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                  shared_expert_intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
                  linear_value_head_dim=128, vocab_size=768, eos_token_id=766, mask_token_id=767)
    return config


def test_written_file(tmp_path):
    from clover.config import CloverConfig
    from clover.gguf.file import GGUFFile

    import clover

    config = small_config()
    path = tmp_path / "model.gguf"
    full_size_gguf.write(path, config, seed=0, log=lambda msg: None)
    want = full_size_gguf.q4_k_m_types(CloverConfig.from_dict(config))
    reader = gguf.GGUFReader(path)                     # the package's own reader and dequantizer
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    assert got == want
    # llama.cpp's Q4_K_M rules at 4 layers: the value maps (3 GDN attn_qkv + 1 attn_v) Q6_K at i = 2, 3
    assert [got[f"blk.{i}.{n}"] for i, n in enumerate(["attn_qkv.weight"] * 3 + ["attn_v.weight"])] == \
        ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [got[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert got["output.weight"] == "Q6_K" and got["token_embd.weight"] == "Q4_K" and got["blk.0.ssm_a"] == "F32"
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_K", "Q6_K"):
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            assert abs(float(w.mean())) < 2e-3 and 0.018 < float(w.std()) < 0.022, t.name
    ssm_a = next(t for t in reader.tensors if t.name == "blk.0.ssm_a")
    assert (np.asarray(ssm_a.data) < 0).all()          # stored as −exp(A_log), as the converter stores it
    with GGUFFile(path) as f:
        assert f.get("tokenizer.ggml.mask_token_id") is not None and len(f.get("tokenizer.ggml.tokens")) == 768
    model = clover.load(path, backend="reference", dtype=torch.float32)
    ids = torch.randint(0, 700, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids)
    assert torch.isfinite(logits).all() and logits.std() > 0
    rb = full_size_gguf.read_bytes(path, 4)
    assert rb["embed_row"] == 256 // 256 * 144 and len(rb["dense"]) == 4 and all(e > 0 for e in rb["expert"])


@pytest.fixture(scope="module")
def written_pair(tmp_path_factory):
    """The small Q4_K_M file and its plain copy (benchmarks.full_size_llama_cpp.ensure_plain)."""
    from benchmarks import full_size_llama_cpp

    config = small_config()
    path = tmp_path_factory.mktemp("plain") / "model.gguf"
    full_size_gguf.write(path, config, seed=0, log=lambda msg: None)
    return path, full_size_llama_cpp.ensure_plain(path, config)


def test_plain_copy_drops_only_clovers_tensors(written_pair):
    """The copy llama.cpp reads: the same bytes for every tensor but Clover's bidirectional ones, the key
    llama.cpp requires, and the same causal logits in Clover (a causal forward reads neither tensor)."""
    import clover
    from clover.gguf.names import EXTRA_TENSORS

    src, plain = written_pair
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(plain)
    left_out = {t.name for t in a.tensors} - {t.name for t in b.tensors}
    assert left_out and all(n.endswith(EXTRA_TENSORS) for n in left_out)
    assert len(left_out) == sum(n.endswith(EXTRA_TENSORS) for n in (t.name for t in a.tensors))
    kept = {t.name: t for t in b.tensors}
    for t in a.tensors:
        if t.name in kept:
            assert kept[t.name].tensor_type == t.tensor_type and np.array_equal(kept[t.name].data, t.data), t.name
    assert list(b.fields["qwen35moe.rope.dimension_sections"].contents()) == [11, 11, 10, 0]
    ids = torch.randint(0, 700, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = clover.load(src, backend="reference", dtype=torch.float32)(ids)
        got = clover.load(plain, backend="reference", dtype=torch.float32)(ids)
    assert torch.equal(got, want)


def test_plain_copy_loads_in_llama_cpp(written_pair):
    """llama.cpp refuses the file with Clover's extra tensors and takes the plain copy, and its logits
    for a prompt are Clover's (the layout transforms undone as llama.cpp reads them; its 8-bit
    activations are the only difference): needs the bench extra."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import clover
    from benchmarks.llama_cpp import logit_agreement

    src, plain = written_pair
    with pytest.raises(ValueError):
        llama_cpp.Llama(model_path=str(src), n_ctx=64, verbose=False)
    llm = llama_cpp.Llama(model_path=str(plain), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == 768
    ids = torch.randint(0, 700, (1, 24), generator=torch.Generator().manual_seed(2))
    llm.eval(ids[0].tolist())
    theirs = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(768,)).copy()
    with torch.inference_mode():
        ours = clover.load(plain, backend="reference", dtype=torch.float32)(ids)[0, -1].numpy()
    agreement = logit_agreement(ours, theirs)
    assert agreement["pearson_r"] > 0.99 and agreement["top_k_shared"] >= 7 and agreement["argmax_rank"] <= 2, agreement


def test_logit_agreement_by_hand():
    """benchmarks.llama_cpp.logit_agreement on a case worked by hand: deviations (−2, −1, 0, 1, 2) and
    (−2, −1, 0, 2, 1) give r = 9/10; both top-2 sets are {3, 4}; a's argmax (id 4) has one larger
    value in b."""
    from benchmarks.llama_cpp import logit_agreement

    got = logit_agreement([1, 2, 3, 4, 5], [1, 2, 3, 5, 4], k=2)
    assert got["top_k_shared"] == 2 and got["argmax_rank"] == 1 and abs(got["pearson_r"] - 0.9) < 1e-12
    assert logit_agreement([3, 1, 2], [1, 2, 3], k=1) == {"pearson_r": -0.5, "top_k": 1, "top_k_shared": 0,
                                                          "argmax_rank": 2}
