"""`clover export` and the model card's Hugging Face quick start (transformers, trust_remote_code=True).

A small random Clover model (the demo tokenizer's vocabulary) is saved as a clover model
directory, exported, and then:
  (a) the card's quick-start script runs in a subprocess where `import clover` fails, in bfloat16, and
      prints what the package itself produces: the thinking, `</think>`, then the answer (its
      `skip_special_tokens=True` drops control tokens, not the thinking markers, as with Qwen3's
      tokenizers), with no warning from transformers on the way (with the trained demo model, when it
      exists, it must also answer a demo question right);
  (b) HF `generate()` gives the package's tokens in float32: LowConfidence (generation_config.json
      defaults and keyword overrides), self-speculative, and a left-padded batch;
  (c) SPEC §9 rejections raise through the HF path before any forward;
  (d) save_pretrained / from_pretrained round-trips (also sharded, also device_map="auto");
  (e) a plain Qwen3.5-MoE checkpoint, exported, loads with AutoModelForCausalLM and gives the logits of
      transformers' own Qwen3_5MoeForCausalLM.
The quick start's max_new_tokens is 24 instead of the card's 24576 (a CPU test on a random model).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import clover
from clover.checkpoint import save_checkpoint
from clover.hf.export import export, main as export_main, remote_code_sources
from clover.tokenization import CloverTokenizer
from tiny_models import make_model, to_transformers

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

DEMO_VOCAB = json.loads((clover.DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"]
TOKENS = dict(vocab_size=DEMO_VOCAB, mask_token_id=5, think_token_id=3, think_end_token_id=4, eos_token_id=[2, 0],
              pad_token_id=0)
GEN_DEFAULTS = {"block_size": 8, "threshold": 0.9, "max_new_tokens": 16}
QUICK_START_NEW_TOKENS = 24

# The model card's quick start, verbatim. Tests change only model_id, the device (device_map and the
# inputs' .to(...)), max_new_tokens and, for the demo model, the question.
CARD_QUICK_START = '''\
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = "Diffuspace/Clover-35B-A3B-Preview"
tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(
    model_id,
    trust_remote_code=True,
    dtype=torch.bfloat16,
    device_map="cuda:0",
).eval()

messages = [{"role": "user", "content": "What is diffusion?"}]
prompt = tokenizer.apply_chat_template(
    messages,
    tokenize=False,
    add_generation_prompt=True,
    enable_thinking=True,
)
inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to("cuda:0")
output = model.generate(
    **inputs,
    max_new_tokens=24576,
    block_size=32,
    threshold=0.95,
    do_sample=False,
)
completion = output[0, inputs["input_ids"].shape[1]:]
print(tokenizer.decode(completion, skip_special_tokens=True))
'''


def quick_start(model_dir, device="cpu", question=None, max_new_tokens=QUICK_START_NEW_TOKENS) -> str:
    """The card's script with model_id set to `model_dir`; on "cpu" the device lines say cpu."""
    edits = [('model_id = "Diffuspace/Clover-35B-A3B-Preview"', f"model_id = {str(model_dir)!r}"),
             ("max_new_tokens=24576", f"max_new_tokens={max_new_tokens}")]
    if device == "cpu":
        edits += [('device_map="cuda:0"', 'device_map="cpu"'), ('.to("cuda:0")', ".to(model.device)")]
    if question is not None:
        edits.append(('"What is diffusion?"', repr(question)))
    script = CARD_QUICK_START
    for old, new in edits:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    return script


def run_without_clover(script: str, workdir: Path) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter where `import clover` raises ImportError (a shim package
    ahead of site-packages), outside the repository, offline, with its own transformers module cache."""
    shim = workdir / "no_clover"
    (shim / "clover").mkdir(parents=True, exist_ok=True)
    (shim / "clover" / "__init__.py").write_text("raise ImportError('clover is not installed here')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(PYTHONPATH=str(shim), HF_HOME=str(workdir / "hf_home"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1",
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    probe = subprocess.run([sys.executable, "-c", "import clover"], cwd=workdir, env=env, capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "ImportError" in probe.stderr, "the subprocess can still import clover"
    path = workdir / "quick_start.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)


def package_completion(model_dir, question="What is diffusion?", dtype=torch.bfloat16, device="cpu",
                       max_new_tokens=QUICK_START_NEW_TOKENS) -> str:
    """What the clover package itself generates for the quick start's request, decoded the same way, on
    the backend the exported code runs there: the reference on CPU (the CPU fast path's kernels round
    differently), the "cuda" backend with step graphs on a GPU."""
    backend = "auto" if torch.device(device).type == "cuda" else "reference"
    model = clover.load(model_dir, dtype=dtype, device=device, backend=backend)
    tok = CloverTokenizer.from_dir(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], enable_thinking=True)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, block_size=32,
                         threshold=0.95, do_sample=False)
    return card_text(tok, out[0, len(ids):].tolist())


def card_text(tok: CloverTokenizer, ids: list[int]) -> str:
    """What the card's users should see for `ids`: the text with the control tokens (`<|im_end|>`,
    `<|endoftext|>`, `<|mask|>`, …) left out and the thinking markers kept, so the thinking and the
    answer stay apart (`…</think>\n\nanswer`), as decoding a Qwen3 completion with skip_special_tokens=True."""
    markers = {tok.think_token_id, tok.think_end_token_id}
    return tok.decode([i for i in ids if i in markers or not tok.is_special(i)])


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and far faster on a busy machine); both sides of every
    comparison, the quick-start subprocess included, use the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A clover model directory (random weights, demo tokenizer) and its export."""
    from clover.training.build_tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("hf_export")
    src, dst = root / "src", root / "exported"
    model = make_model(seed=3, **TOKENS)
    save_checkpoint(model, model.config, src)
    (src / "generation_config.json").write_text(json.dumps(GEN_DEFAULTS))
    build_tokenizer(str(src))
    export(src, dst)
    return SimpleNamespace(root=root, src=src, dst=dst)


@pytest.fixture(scope="module")
def hf_model(dirs):
    model = AutoModelForCausalLM.from_pretrained(dirs.dst, trust_remote_code=True, dtype=torch.float32,
                                                 device_map="cpu").eval()
    assert type(model).__module__.startswith("transformers_modules."), "not loaded as remote code"
    return model


@pytest.fixture(scope="module")
def ours(dirs):
    return clover.load(dirs.src, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(dirs):
    return AutoTokenizer.from_pretrained(dirs.dst, trust_remote_code=True)


def chat_ids(tokenizer, question: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


# ---- the exported directory ---------------------------------------------------------------------
def test_export_writes_a_complete_model_directory(dirs):
    names = {p.name for p in dirs.dst.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "configuration_clover.py",
            "modeling_clover.py", "tokenizer.json", "tokenizer_config.json"} <= names
    assert set(remote_code_sources()) <= names
    cfg = json.loads((dirs.dst / "config.json").read_text())
    assert cfg["model_type"] == "clover"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_clover.CloverConfig"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_clover.CloverForCausalLM"
    gen = json.loads((dirs.dst / "generation_config.json").read_text())
    for key in ("block_size", "threshold", "decoding", "draft_steps", "max_new_tokens", "do_sample", "temperature",
                "top_p", "eos_token_id", "pad_token_id", "mask_token_id", "dllm_repetition_penalty",
                "dllm_think_end_window"):
        assert key in gen, key
    assert gen["block_size"] == 8 and gen["threshold"] == 0.9 and gen["mask_token_id"] == 5
    assert gen["eos_token_id"] == [2, 0]
    # Remote code is flat and self-contained: no package-relative or clover imports left.
    for name in remote_code_sources():
        for node in ast.walk(ast.parse((dirs.dst / name).read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1) and (node.module or "").split(".")[0] != "clover", (name, node.lineno)
                if node.level == 1:
                    assert (dirs.dst / f"{node.module}.py").exists(), (name, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "clover" for a in node.names), (name, node.lineno)
    # The exported directory is still a clover model directory.
    again = clover.load(dirs.dst, dtype=torch.float32)
    ids = torch.arange(6, 40)[None]
    assert torch.equal(again(ids), clover.load(dirs.src, dtype=torch.float32)(ids))


def test_exported_generation_config_has_no_flag_transformers_calls_ignored(dirs):
    """transformers flags sampling-only values set on a greedy config ("generation flags are not valid
    and may be ignored: ['top_k']" on every load); top_k 0 means "off", which an absent top_k also means
    to Clover, so the export leaves it out; a real top_k is kept."""
    from clover.config import CloverConfig
    from clover.hf.export import generation_config_dict

    transformers.GenerationConfig.from_pretrained(dirs.dst).validate(strict=True)
    assert "top_k" not in json.loads((dirs.dst / "generation_config.json").read_text())
    config = CloverConfig.from_file(dirs.src)
    assert generation_config_dict(config, {"do_sample": True, "top_k": 20})["top_k"] == 20
    hf_model = AutoModelForCausalLM.from_pretrained(dirs.dst, trust_remote_code=True, dtype=torch.float32)
    ids = torch.tensor([chat_ids(AutoTokenizer.from_pretrained(dirs.dst), "Hi")])
    ours = clover.load(dirs.src, dtype=torch.float32)
    for settings in ({}, {"do_sample": True, "seed": 3}):       # absent top_k: no top-k filter, as in the source
        assert torch.equal(hf_model.generate(ids, max_new_tokens=8, **settings),
                           ours.generate(ids, max_new_tokens=8, **settings))


def test_exported_tokenizer_keeps_the_thinking_markers_when_skipping_special_tokens(dirs, tokenizer):
    """The card decodes with skip_special_tokens=True: control tokens go, `<think>`/`</think>` stay
    (ordinary added tokens, as Qwen3's tokenizers mark them), and still encode as one token each."""
    ours = CloverTokenizer.from_dir(dirs.src)
    think, end, im_end, mask = (ours.token_to_id(t) for t in ("<think>", "</think>", "<|im_end|>", "<|mask|>"))
    ids = [think] + ours.encode("\nsteps\n") + [end] + ours.encode("\n\n42") + [mask, im_end]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nsteps\n</think>\n\n42"
    assert tokenizer.decode(ids, skip_special_tokens=False) == ours.decode(ids)
    assert tokenizer("a</think>b<|im_end|>", add_special_tokens=False)["input_ids"] == ours.encode("a</think>b<|im_end|>")
    assert {"<|im_end|>", "<|im_start|>", "<|mask|>"} <= set(tokenizer.all_special_tokens)
    assert not {"<think>", "</think>"} & set(tokenizer.all_special_tokens)
    assert ours.is_special(end)                  # the source directory is left as it was


# ---- (a) the card's quick start, without clover installed ----------------------------------------
def test_card_quick_start_runs_without_clover(dirs):
    expected = package_completion(dirs.src)
    assert expected.strip(), "the random model should produce some text"
    result = run_without_clover(quick_start(dirs.dst), dirs.root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected + "\n"
    assert "not valid and may be ignored" not in result.stderr, result.stderr[-3000:]


DEMO_MODEL = Path(clover.__file__).parent / "demo" / "model"


@pytest.mark.skipif(not (DEMO_MODEL / "config.json").exists(), reason="no trained demo model in this checkout")
def test_card_quick_start_answers_a_demo_question(tmp_path):
    """The trained demo model, exported, answers a held-out demo question through the card's script."""
    from clover.training.tasks import sample_examples

    dst = export(DEMO_MODEL, tmp_path / "demo_export")
    for example in sample_examples(12, "heldout", seed=0):
        question = example.messages[-1]["content"]
        expected = package_completion(DEMO_MODEL, question, max_new_tokens=128)
        thinking, marker, answer = expected.partition("</think>")
        if marker and thinking.strip() and answer.strip() == example.answer:
            break
    else:
        pytest.fail("the demo model answered none of 12 held-out questions (package path, bfloat16)")
    result = run_without_clover(quick_start(dst, question=question, max_new_tokens=128), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected + "\n"
    assert result.stdout.split("</think>")[-1].strip() == example.answer
    assert "not valid and may be ignored" not in result.stderr, result.stderr[-3000:]    # the demo's top_k: 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_card_quick_start_on_cuda_verbatim(dirs):
    """The card's script with only model_id (and max_new_tokens) changed: device_map="cuda:0"."""
    expected = package_completion(dirs.src, device="cuda:0")
    result = run_without_clover(quick_start(dirs.dst, device="cuda:0"), dirs.root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected + "\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_wrapper_runs_the_cuda_backend_with_graphs_on_a_gpu(dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(dirs.dst), trust_remote_code=True, dtype=torch.bfloat16,
                                              device_map="cuda:0").eval()
    rt = hf.clover_model()
    assert rt.backend.name == "cuda" and rt.runner.graph_replay == "cuda"


# ---- (b) HF generate == clover generate, float32 --------------------------------------------------
def _expected_rows(ours, prompts, width, pad, **settings):
    """transformers' layout of the package's results: [left-padded prompt | completion | pad]."""
    outs = [ours.generate(torch.tensor([p]), **settings)[0, len(p):].tolist() for p in prompts]
    new = max(len(o) for o in outs)
    rows = []
    for p, o in zip(prompts, outs):
        rows.append([pad] * (width - len(p)) + p + o + [pad] * (new - len(o)))
    return torch.tensor(rows), outs


def test_generate_uses_generation_config_defaults(hf_model, ours, tokenizer):
    ids = chat_ids(tokenizer, "Hello! How can I help you today?")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! How can I help you today?"}],
                                           add_generation_prompt=True, enable_thinking=True, return_dict=True,
                                           return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    out = hf_model.generate(**inputs)                          # block_size 8, threshold 0.9, 16 tokens
    ref = ours.generate(torch.tensor([ids]))
    assert torch.equal(out, ref)
    assert out.shape[1] - len(ids) <= GEN_DEFAULTS["max_new_tokens"]


@pytest.mark.parametrize("settings", [
    dict(block_size=4, threshold=0.95, max_new_tokens=13),
    dict(block_size=32, threshold=0.95, max_new_tokens=24, do_sample=False),
    dict(decoding="self_speculative", block_size=4, max_new_tokens=14),
    dict(block_size=1, max_new_tokens=9, dllm_repetition_penalty=1.3),
], ids=["low_confidence_b4", "low_confidence_b32", "self_speculative", "autoregressive"])
def test_generate_matches_package(hf_model, ours, tokenizer, settings):
    ids = chat_ids(tokenizer, "What is 12+34?")
    out = hf_model.generate(torch.tensor([ids]), **settings)
    ref = ours.generate(torch.tensor([ids]), **settings)
    assert torch.equal(out, ref)
    assert 1 <= out.shape[1] - len(ids) <= settings["max_new_tokens"]


def test_generate_hard_limit_is_max_new_tokens(hf_model, tokenizer):
    ids = torch.tensor([chat_ids(tokenizer, "Sort 3, 1, 2.")])
    out = hf_model.generate(ids, max_new_tokens=5, block_size=8, dllm_length_penalty_strength=0.0,
                            eos_token_id=[511])             # an id the model is unlikely to emit: no early stop
    assert out.shape[1] - ids.shape[1] == 5


def test_streamer_receives_prompt_then_completion(hf_model, tokenizer):
    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.tolist())

        def end(self):
            self.ended = True

    ids = torch.tensor([chat_ids(tokenizer, "What is 5+6?")])
    streamer = Collect()
    out = hf_model.generate(ids, streamer=streamer, max_new_tokens=8, block_size=4)
    assert streamer.ended and streamer.parts[0] == ids[0].tolist()
    assert sum(streamer.parts[1:], []) == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("decoding", ["low_confidence", "self_speculative"])
def test_left_padded_batch_matches_each_prompt_alone(hf_model, ours, tokenizer, decoding):
    questions = ["What is 7+8?", "Reverse the letters a b c d e f.", "Hi"]
    prompts = [chat_ids(tokenizer, q) for q in questions]
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True) for q in questions]
    batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert int(batch["attention_mask"].sum(1).min()) < batch["input_ids"].shape[1]   # really padded
    settings = dict(block_size=4, max_new_tokens=10, decoding=decoding)
    out = hf_model.generate(**batch, **settings)
    expected, outs = _expected_rows(ours, prompts, batch["input_ids"].shape[1], 0, **settings)
    assert torch.equal(out, expected)


# ---- (c) SPEC §9 rejections ------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    (dict(max_new_tokens=4090, block_size=32), "context"),            # prompt + 128 blocks of 32 > 4096
    (dict(max_new_tokens=4070, block_size=32), "context"),            # the final block is resolved whole
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(dllm_repetition_penalty=0.0), "dllm_repetition_penalty"),
    (dict(blocksize=8), "unknown generation setting"),
])
def test_rejections_raise_before_any_forward(hf_model, tokenizer, settings, message):
    ids = torch.tensor([chat_ids(tokenizer, "What is 1+2?")])
    assert ids.shape[1] + 4070 <= 4096          # so the second case fails only by the whole final block
    calls = []
    hook = hf_model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            hf_model.generate(ids, **settings)
    finally:
        hook.remove()
    assert not calls, "a forward ran before the request was rejected"


def test_empty_prompt_is_rejected(hf_model):
    with pytest.raises(ValueError, match="empty"):
        hf_model.generate(torch.tensor([[1, 2]]), attention_mask=torch.tensor([[0, 0]]))


# ---- (d) loading and saving ------------------------------------------------------------------------
def same_logits(a, b):
    """The same function of the same weights, to float32 rounding. Bit identity across batch shapes,
    padding or separately loaded copies of the weights is not something the code promises: MKL picks
    shape- and alignment-dependent kernels (on AMD EPYC they differ by ~1e-7 unless MKL_CBWR is set)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return True


def test_forward_gives_causal_logits(hf_model, ours):
    ids = torch.randint(6, DEMO_VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    out = hf_model(input_ids=ids)
    assert out.logits.shape == (2, 30, DEMO_VOCAB)
    assert same_logits(out.logits, ours(ids))
    # Left padding: each row's real tokens give the logits of that row alone.
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    padded = hf_model(input_ids=ids, attention_mask=mask).logits
    assert same_logits(padded[0], ours(ids[:1])[0])
    assert torch.allclose(padded[1, 7:], ours(ids[1:, 7:])[0], atol=1e-5)
    loss = hf_model(input_ids=ids, labels=ids).loss
    assert loss is not None and torch.isfinite(loss)


def test_save_pretrained_round_trip(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    ids = torch.randint(6, DEMO_VOCAB, (1, 25), generator=torch.Generator().manual_seed(1))
    # The saved weights are the same numbers (exact), the reloaded model the same function (to rounding).
    saved = {k: v for k, v in again.state_dict().items()}
    assert all(torch.equal(v, saved[k]) for k, v in hf_model.state_dict().items())
    assert same_logits(again(ids).logits, hf_model(ids).logits)
    assert again.generation_config.block_size == 8
    assert torch.equal(again.generate(ids, max_new_tokens=6), hf_model.generate(ids, max_new_tokens=6))
    # The saved directory is a clover model directory too.
    assert same_logits(clover.load(tmp_path / "saved", dtype=torch.float32)(ids), hf_model(ids).logits)


def test_package_class_saves_a_loadable_directory(dirs, tmp_path):
    """clover.hf.modeling_clover works in the package too; its save_pretrained writes the remote code."""
    from clover.hf.modeling_clover import CloverForCausalLM

    model = CloverForCausalLM.from_pretrained(dirs.dst, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True, dtype=torch.float32)
    assert type(again).__module__.startswith("transformers_modules.")
    ids = torch.randint(6, DEMO_VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    assert same_logits(again(ids).logits, model(ids).logits)


def test_dtype_device_map_and_sharding(dirs, ours, tmp_path):
    sharded = tmp_path / "sharded"
    assert export_main([str(dirs.src), str(sharded), "--max-shard-size", "60KB"]) == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(sharded, trust_remote_code=True, dtype=torch.bfloat16,
                                                 device_map="auto")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.randint(6, DEMO_VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    bf16 = clover.load(dirs.src, dtype=torch.bfloat16, backend="reference")     # what the wrapper runs on CPU
    assert torch.equal(model(ids).logits, bf16(ids))
    assert export_main([str(dirs.src), str(sharded)]) == 2          # refuses a non-empty DST without --force


def test_missing_block_parameters_load_as_block_readout_off(dirs, ours, tmp_path):
    """Weights without Clover's block parameters: conv1d_right = 0, block_mix_logits = [0, -inf] (SPEC §3);
    nothing that was loaded is re-initialised."""
    import shutil

    path = tmp_path / "no_block_params"
    shutil.copytree(dirs.dst, path)
    save_checkpoint(ours, json.loads((path / "config.json").read_text()), path, include_clover_params=False)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    stored = ours.state_dict()
    for name, tensor in model.state_dict().items():
        if name.endswith("conv1d_right.weight"):
            assert not tensor.any(), name
        elif name.endswith("block_mix_logits"):
            assert not tensor[:, 0].any() and bool(torch.isneginf(tensor[:, 1]).all()), name
        else:
            assert torch.equal(tensor, stored[name]), name
    ids = torch.randint(6, DEMO_VOCAB, (1, 20), generator=torch.Generator().manual_seed(5))
    assert torch.equal(model(ids).logits, ours(ids))


def test_from_config_builds_a_working_model(dirs):
    config = AutoConfig.from_pretrained(dirs.dst, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert all(torch.isfinite(p).all() for n, p in model.named_parameters() if not n.endswith("block_mix_logits"))
    assert torch.isfinite(model(torch.tensor([[6, 7, 8]])).logits).all()


# ---- (e) a plain Qwen3.5-MoE checkpoint ----------------------------------------------------------------
def test_qwen_checkpoint_exports_and_loads_causally(tmp_path):
    model = make_model("tied_gqa4", seed=21)
    reference = to_transformers(model, tmp_path / "qwen")
    assert json.loads((tmp_path / "qwen" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    dst = export(tmp_path / "qwen", tmp_path / "qwen_export")
    assert AutoConfig.from_pretrained(dst, trust_remote_code=True).mask_token_id is None
    hf = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True, dtype=torch.float32,
                                              device_map="cpu").eval()
    for layer in hf.model.layers:
        if hasattr(layer, "linear_attn"):
            assert not layer.linear_attn.conv1d_right.weight.any()
            mix = layer.linear_attn.block_mix_logits
            assert torch.equal(mix[:, 0], torch.zeros_like(mix[:, 0])) and bool(torch.isneginf(mix[:, 1]).all())
    ids = torch.randint(0, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = hf(ids).logits
        theirs = reference(ids, use_cache=False).logits
    assert (ours - theirs).abs().max().item() <= 5e-4
    assert ours.std() > 0.1
    # Causal use: generation defaults to autoregressive decoding (block_size=1 in generation_config.json),
    # which equals transformers' greedy decoding with the controls off.
    prompt = ids[:1, :12]
    out = hf.generate(prompt, max_new_tokens=6, dllm_repetition_penalty=1.0)
    ref = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0, : ref.shape[1]], ref[0])
    with pytest.raises(ValueError, match="mask"):
        hf.generate(prompt, max_new_tokens=4, block_size=4)
    # The hub's per-expert layout converts to the same model.
    cfg = json.loads((tmp_path / "qwen" / "config.json").read_text())
    save_checkpoint(model, cfg, tmp_path / "qwen_per_expert", layout="per_expert", include_clover_params=False)
    per_expert = export(tmp_path / "qwen_per_expert", tmp_path / "qwen_per_expert_export")
    hf2 = AutoModelForCausalLM.from_pretrained(per_expert, trust_remote_code=True, dtype=torch.float32)
    assert torch.equal(hf2(ids).logits, ours)
