"""Training: data layout (loss masks, block alignment), determinism, and that a short run learns."""

import json
import random

import pytest
import torch

from clover.training.data import (IGNORE, DiffusionItem, TokenizedExample, TrainingStream, causal_batch,
                                  causal_targets, diffusion_batch, diffusion_item, noise_block, num_blocks)

PAD, IM_END, THINK, THINK_END, MASK = 0, 2, 3, 4, 5


# ---- hand-checked data layout -------------------------------------------------------------------
# prompt: 5 tokens (10..14); completion: 7 tokens (20..25, then <|im_end|>)
SEQ = TokenizedExample(ids=(10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 25, IM_END), prompt_len=5)


def test_causal_targets_cover_only_completion_tokens():
    assert causal_targets(SEQ) == [IGNORE] * 4 + [20, 21, 22, 23, 24, 25, IM_END, IGNORE]
    short = TokenizedExample(ids=(10, 11, 30, IM_END), prompt_len=2)
    batch = causal_batch([SEQ, short], pad_id=PAD)
    assert batch.input_ids.shape == (2, 12) and batch.block_len == 0
    assert batch.input_ids[1].tolist() == [10, 11, 30, IM_END] + [PAD] * 8     # right padding
    assert batch.targets[1].tolist() == [IGNORE, 30, IM_END] + [IGNORE] * 9    # none on prompt/padding
    assert batch.num_loss_tokens == 7 + 2


def test_blocks_are_aligned_as_generation_sees_them():
    assert num_blocks(SEQ, 4) == 2 and num_blocks(SEQ, 32) == 1 and num_blocks(SEQ, 7) == 1
    first = diffusion_item(SEQ, 4, 0, PAD)
    assert first.prefix == (10, 11, 12, 13, 14) and first.block == (20, 21, 22, 23)
    second = diffusion_item(SEQ, 4, 1, PAD)     # prefix = prompt + one resolved block
    assert second.prefix == (10, 11, 12, 13, 14, 20, 21, 22, 23)
    assert second.block == (24, 25, IM_END, PAD)                                 # padded after the EOS
    whole = diffusion_item(SEQ, 32, 0, PAD)
    assert whole.prefix == SEQ.ids[:5] and whole.block == SEQ.ids[5:] + (PAD,) * 25
    with pytest.raises(ValueError):
        diffusion_item(SEQ, 4, 2, PAD)          # generation never resolves a block past the EOS one


def test_noise_masks_at_least_one_and_loss_only_on_masked_positions():
    rng = random.Random(0)
    item = DiffusionItem(prefix=(10, 11, 12), block=(20, 21, 22, 23))
    for _ in range(200):
        noisy, masked = noise_block(item.block, MASK, rng)
        assert any(masked)
        assert noisy == [MASK if m else t for t, m in zip(item.block, masked)]
    other = DiffusionItem(prefix=(40, 41, 42), block=(50, IM_END, PAD, PAD))
    batch = diffusion_batch([item, other], MASK, random.Random(1))
    assert batch.block_len == 4 and batch.input_ids.shape == (2, 7)
    assert batch.input_ids[:, :3].tolist() == [[10, 11, 12], [40, 41, 42]]       # clean prefix
    assert (batch.targets[:, :3] == IGNORE).all()
    for row, it in enumerate((item, other)):
        for j in range(4):
            tok, tgt = int(batch.input_ids[row, 3 + j]), int(batch.targets[row, 3 + j])
            if tok == MASK:
                assert tgt == it.block[j]       # no shift: the block position's own token
            else:
                assert tok == it.block[j] and tgt == IGNORE
    with pytest.raises(ValueError):
        diffusion_batch([item, DiffusionItem((1, 2), (3, 4, 5, 6))], MASK, random.Random(0))


def test_frontier_noise_keeps_the_left_clean_and_masks_from_a_cut():
    rng = random.Random(0)
    block = tuple(range(20, 52))
    cuts, right, right_masked = set(), 0, 0
    for _ in range(400):
        noisy, masked = noise_block(block, MASK, rng, frontier_prob=1.0)
        cut = masked.index(True)
        cuts.add(cut)
        right += len(block) - cut - 1
        right_masked += masked[cut + 1:].count(True)
        assert noisy == [MASK if m else t for t, m in zip(block, masked)]
    assert len(cuts) > 25                       # the cut moves over the whole block
    assert 0.68 < right_masked / right < 0.82   # right of the cut: masked with q ~ U(0.5, 1), mean 0.75
    # frontier_prob 0 is exactly the uniform noise (same draws from the same rng)
    a, b = random.Random(5), random.Random(5)
    assert [noise_block(block, MASK, a) for _ in range(20)] == [noise_block(block, MASK, b, 0.0) for _ in range(20)]
    with pytest.raises(ValueError, match="frontier_prob"):
        TrainingStream(None, batch_size=2, frontier_prob=1.5)


def _prompt_len(row: list[int]) -> int:
    """End of the generation prompt `<|im_start|>assistant\\n<think>\\n` (+ `\\n</think>\\n\\n` when off)."""
    i = row.index(THINK)
    return i + 6 if row[i + 3] == THINK_END else i + 2


def test_stream_is_deterministic_and_blocks_sit_at_block_boundaries(tmp_path):
    from clover.tokenization import CloverTokenizer
    from clover.training.build_tokenizer import build_tokenizer

    build_tokenizer(str(tmp_path))
    tok = CloverTokenizer.from_dir(tmp_path)
    a = TrainingStream(tok, batch_size=8, seed=3, chunk_size=256)
    b = TrainingStream(tok, batch_size=8, seed=3, chunk_size=256)
    c = TrainingStream(tok, batch_size=8, seed=4, chunk_size=256)
    block_sizes, differs = set(), False
    for (ca, da), (cb, db), (cc, _) in zip(a, b, c):
        assert torch.equal(ca.input_ids, cb.input_ids) and torch.equal(da.input_ids, db.input_ids)
        assert torch.equal(da.targets, db.targets)
        differs |= not torch.equal(ca.input_ids, cc.input_ids)
        L = da.block_len
        block_sizes.add(L)
        P = da.input_ids.shape[1] - L
        for row, tgt in zip(da.input_ids.tolist(), da.targets.tolist()):
            assert (P - _prompt_len(row)) % L == 0                             # prompt + n full blocks
            assert all(t == IGNORE for t in tgt[:P]) and any(t != IGNORE for t in tgt[P:])
            assert all((t == MASK) == (g != IGNORE) for t, g in zip(row[P:], tgt[P:]))
        for row, tgt in zip(ca.input_ids.tolist(), ca.targets.tolist()):       # causal: completion only
            start = _prompt_len(row) - 1
            assert all(t == IGNORE for t in tgt[:start]) and tgt[start] == row[start + 1]
        if len(block_sizes) > 2:
            break
    assert 32 in block_sizes and len(block_sizes) > 1                             # shorter blocks too
    assert differs                                                                 # seed matters


# ---- training -----------------------------------------------------------------------------------
def _run(steps, seed=0, out=None):
    from clover.training.train import train_model

    return train_model(out, steps=steps, seed=seed, batch_size=8, lr=3e-3, config_size="tiny",
                       log=lambda s: None, log_every=1000)


def test_short_run_lowers_both_losses():
    hist = _run(30).history
    assert len(hist) == 30
    for key in ("causal", "diffusion"):
        first = sum(r[key] for r in hist[:5]) / 5
        last = sum(r[key] for r in hist[-5:]) / 5
        assert last < first - 0.5, (key, first, last)


def test_same_seed_same_losses():
    a, b = _run(4, seed=7).history, _run(4, seed=7).history
    assert [(r["causal"], r["diffusion"]) for r in a] == [(r["causal"], r["diffusion"]) for r in b]
    c = _run(4, seed=8).history
    assert [r["causal"] for r in a] != [r["causal"] for r in c]


def test_saved_directory_loads(tmp_path):
    import clover
    from clover.training.train import GENERATION_CONFIG

    result = _run(2, out=tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "clover" and cfg["mask_token_id"] == MASK and cfg["eos_token_id"] == [2, 0]
    assert cfg["think_token_id"] == THINK and cfg["think_end_token_id"] == THINK_END
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen == GENERATION_CONFIG and gen["block_size"] == 32 and gen["threshold"] == 0.95
    model = clover.load(tmp_path, backend="reference")                 # the saved weights, exactly as trained
    ids = torch.tensor([[1, 40, 41, 2, 1, 42]])
    assert torch.allclose(model(ids), result.model(ids), atol=1e-6)
    assert torch.allclose(model(torch.cat([ids, torch.full((1, 4), MASK)], 1), block_len=4),
                          result.model(torch.cat([ids, torch.full((1, 4), MASK)], 1), block_len=4), atol=1e-6)


def test_warm_start_keeps_its_models_tokenizer(tmp_path):
    """--init-from continues with the init model's tokenizer files (its ids), not a rebuilt one."""
    from clover.training.train import TOKENIZER_FILES, train_model

    _run(2, out=tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 1234            # a mark a rebuilt tokenizer would not carry
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(cfg))
    train_model(tmp_path / "b", steps=2, batch_size=8, lr=1e-3, init_from=tmp_path / "a", log=lambda s: None)
    for name in TOKENIZER_FILES:
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name


def test_save_every_writes_a_loadable_directory_mid_run(tmp_path):
    import clover
    from clover.training.train import train_model

    saved_at = []
    train_model(tmp_path, steps=4, batch_size=8, lr=1e-3, config_size="tiny", save_every=2,
                log=lambda s: saved_at.append(s) if s.startswith("saved step") else None)
    assert saved_at == [f"saved step 2 to {tmp_path}"]          # step 4 is the final save
    model = clover.load(tmp_path)
    assert model.config.hidden_size == 64


# ---- decode-state noise -------------------------------------------------------------------------
def _plain_decode_state(model, row: list[int], L: int, mask: int, steps: int, tau: float) -> list[int]:
    """One row, written out: teacher-forced SPEC §5 fill rule, stopping before the block resolves."""
    P = len(row) - L
    x = row[:P] + [mask] * L
    for _ in range(steps):
        with torch.no_grad():
            conf = model(torch.tensor([x]), block_len=L)[0, P:].float().softmax(-1).max(-1).values.tolist()
        masked = [j for j in range(L) if x[P + j] == mask]
        fill = [j for j in masked if conf[j] > tau] or [max(masked, key=lambda j: (conf[j], -j))]
        if len(fill) == len(masked):
            break
        for j in fill:
            x[P + j] = row[P + j]
    return x


def _demo_diffusion_batch(seed: int):
    import clover
    from clover.tokenization import CloverTokenizer

    model = clover.load(clover.DEMO_MODEL_DIR, dtype=torch.float32)
    tok = CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)
    stream = iter(TrainingStream(tok, batch_size=6, seed=seed))
    batch = next(b for _, b in stream if b.block_len == 32)
    return model, batch


def test_decode_states_follow_the_fill_rule_row_by_row():
    from tiny_models import make_model

    from clover.training.decode_states import lowconfidence_state

    model = make_model(seed=3)
    mask, L = model.config.mask_token_id, 8
    clean = torch.randint(5, mask, (4, 12 + L), generator=torch.Generator().manual_seed(0))
    first = clean.clone()
    first[:, -L:] = mask
    with torch.no_grad():
        conf = model(first, block_len=L)[:, -L:].softmax(-1).amax(-1)
    # τ halfway between a row's two middle first-step confidences: half the block passes, the rest
    # waits, and no confidence sits at τ (batched and single-row forwards differ by float rounding);
    # τ = 1: one fallback fill per step; τ = 0: the block would resolve at once, so it stays all-mask
    middle = conf.sort(-1).values[:, L // 2 - 1: L // 2 + 1].mean(-1)
    steps, taus = [1, 3, 3, 2], [middle[0].item(), middle[1].item(), 1.0, 0.0]
    states = lowconfidence_state(model, clean, L, mask, steps, taus)
    for r in range(4):
        assert states[r].tolist() == _plain_decode_state(model, clean[r].tolist(), L, mask, steps[r], taus[r])
    still = (states[:, -L:] == mask).sum(1).tolist()
    assert 0 < still[0] < L and still[2] == L - 3 and still[3] == L


def test_with_decode_states_takes_loss_on_the_still_masked_positions():
    from clover.training.decode_states import with_decode_states

    model, batch = _demo_diffusion_batch(seed=6)
    mask, P = model.config.mask_token_id, batch.input_ids.shape[1] - 32
    clean = torch.where(batch.targets != IGNORE, batch.targets, batch.input_ids)
    assert with_decode_states(model, batch, mask, random.Random(0), 0.0) is batch
    out = with_decode_states(model, batch, mask, random.Random(0), 1.0)
    assert torch.equal(out.input_ids[:, :P], clean[:, :P]) and out.block_len == 32
    block, targets = out.input_ids[:, P:], out.targets[:, P:]
    still = block == mask
    assert still.any(1).all()                                  # every row keeps something to learn
    assert torch.equal(torch.where(still, clean[:, P:], block), clean[:, P:])   # revealed = clean tokens
    assert torch.equal(targets, torch.where(still, clean[:, P:], IGNORE))
    assert (out.targets[:, :P] == IGNORE).all()


def test_training_with_decode_states_is_deterministic_and_changes_the_diffusion_rows():
    from clover.training.train import train_model

    def run(prob):
        return [r["diffusion"] for r in train_model(None, steps=3, seed=1, batch_size=4, lr=1e-3,
                                                     config_size="tiny", decode_state_prob=prob,
                                                     log=lambda s: None).history]

    assert run(1.0) == run(1.0)
    assert run(1.0) != run(0.0)
