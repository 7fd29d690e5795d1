"""Grow a trained model's BPE vocabulary for new text (the demo's tool chats) without changing how it
tokenizes the text it was trained on.

The demo tokenizer's 250 merges were learnt on the task chats; the tool schemas in a system turn
(JSON, the template's instructions) fall apart into ~1.2 characters per token, so a three-tool
prompt is ~850 tokens and training on it is ~10x slower than on a task chat. `learn_merges` continues
BPE on the new text: it starts from the current tokenization of each pre-token and repeatedly merges
the most frequent adjacent pair — never a pair that occurs in the protected text's tokenization
(the old corpus). HF BPE applies merges in rank order, and appended merges rank after every old one,
so on protected text no new merge ever finds its pair: old text tokenizes exactly as before.
`extend_model` appends the new tokens to a model directory: embedding rows start at the mean of
their two parts' rows (the model reads the new token about as it read its pieces), lm_head rows at
zero (no new token is predicted until training asks for it).

    python -m clover.training.extend_tokenizer SRC_MODEL_DIR OUT_DIR [--merges 384] [--min-count 40]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer

from clover.tokenization import SPECIAL_TOKENS

_SPECIALS = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))


def _words(tokenizer: Tokenizer, texts: Iterable[str]) -> Counter:
    """Pre-token frequencies (byte-level strings) of `texts`, special tokens cut out as encoding does."""
    words: Counter = Counter()
    for text in texts:
        for piece in _SPECIALS.split(text):
            if piece:
                words.update(w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str(piece))
    return words


def _tokens(tokenizer: Tokenizer, word: str) -> list[str]:
    return [t.value for t in tokenizer.model.tokenize(word)]


def learn_merges(tokenizer: Tokenizer, texts: Iterable[str], protected: Iterable[str],
                 n_merges: int, min_count: int = 40) -> list[tuple[str, str]]:
    """Up to `n_merges` new merges for `texts`, most frequent first, none of them a pair adjacent in
    the tokenization of `protected`; stops when the best pair occurs fewer than `min_count` times."""
    forbidden = set()
    for word in _words(tokenizer, protected):
        toks = _tokens(tokenizer, word)
        forbidden.update(zip(toks, toks[1:]))
    vocab = tokenizer.get_vocab()
    words = [(_tokens(tokenizer, w), n) for w, n in _words(tokenizer, texts).items()]
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for toks, n in words:
            for pair in zip(toks, toks[1:]):
                pairs[pair] += n
        best = next(((p, c) for p, c in pairs.most_common() if p not in forbidden and p[0] + p[1] not in vocab),
                    None)
        if best is None or best[1] < min_count:
            break
        (a, b), _ = best
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        for toks, _n in words:
            i = 0
            while i < len(toks) - 1:
                if toks[i] == a and toks[i + 1] == b:
                    toks[i : i + 2] = [a + b]
                i += 1
    return merges


def extended_tokenizer_json(tokenizer_json: dict, merges: list[tuple[str, str]]) -> dict:
    """The tokenizer.json with `merges` appended (new ids after the last one)."""
    out = json.loads(json.dumps(tokenizer_json))
    model = out["model"]
    next_id = max(model["vocab"].values()) + 1
    string_merges = model["merges"] and isinstance(model["merges"][0], str)
    for a, b in merges:
        model["vocab"][a + b] = next_id
        next_id += 1
        model["merges"].append(f"{a} {b}" if string_merges else [a, b])
    return out


def extend_model(src: str | Path, out: str | Path, merges: list[tuple[str, str]]) -> Path:
    """Write `src`'s model directory to `out` with the new tokens: tokenizer, config vocab_size,
    embedding and lm_head rows (see the module docstring)."""
    from clover import load
    from clover.checkpoint import write_checkpoint
    from clover.config import CloverConfig
    from clover.model import CloverForCausalLM
    from clover.staging import staged_directory

    src, out = Path(src), Path(out)
    tok_json = json.loads((src / "tokenizer.json").read_text())
    new_json = extended_tokenizer_json(tok_json, merges)
    vocab = new_json["model"]["vocab"]
    old = load(src, dtype=torch.float32, backend="reference")
    V_old = old.config.vocab_size
    V_new = max(V_old, max(vocab.values()) + 1)
    cfg = old.config.to_dict()
    cfg["vocab_size"] = V_new
    model = CloverForCausalLM(CloverConfig.from_dict(cfg))
    state = old.state_dict()
    emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    new_emb = torch.zeros(V_new, emb.shape[1])
    new_emb[:V_old] = emb
    new_head = torch.zeros(V_new, head.shape[1])
    new_head[:V_old] = head
    for a, b in merges:
        new_emb[vocab[a + b]] = (new_emb[vocab[a]] + new_emb[vocab[b]]) / 2
    state["model.embed_tokens.weight"], state["lm_head.weight"] = new_emb, new_head
    model.load_state_dict(state)
    if out.exists():
        raise FileExistsError(f"{out} exists")
    with staged_directory(out) as staging:
        write_checkpoint(model, {**cfg, "dtype": "float32"}, staging, dtype=torch.float32)
        for name in src.iterdir():
            if name.name not in ("model.safetensors", "config.json", "tokenizer.json") and name.is_file():
                shutil.copyfile(name, staging / name.name)
        (staging / "tokenizer.json").write_text(json.dumps(new_json, ensure_ascii=False))
    return out


def demo_texts(n: int = 3000, seed: int = 0) -> tuple[list[str], list[str]]:
    """(tool chats to learn merges on, the evaluated tasks' chats to protect)."""
    from clover.training.tasks import TASK_NAMES, TOOL_TASKS, TRAINING_ONLY_TASKS, generate_example

    rng = random.Random(seed)
    new, protected = [], []
    for i in range(n):
        ex = generate_example(TOOL_TASKS[i % len(TOOL_TASKS)], rng)
        new.append(ex.prompt_text(i % 2 == 0) + ex.completion_text(i % 2 == 0))
    plain = (*TASK_NAMES, *TRAINING_ONLY_TASKS)
    for i in range(4 * n):
        ex = generate_example(plain[i % len(plain)], rng)
        protected.append(ex.prompt_text(i % 2 == 0) + ex.completion_text(i % 2 == 0))
    return new, protected


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clover.training.extend_tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--merges", type=int, default=384)
    p.add_argument("--min-count", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tokenizer = Tokenizer.from_file(str(Path(args.src) / "tokenizer.json"))
    new, protected = demo_texts(seed=args.seed)
    merges = learn_merges(tokenizer, new, protected, args.merges, args.min_count)
    extend_model(args.src, args.out, merges)
    print(f"{len(merges)} merges added: vocabulary {tokenizer.get_vocab_size()} -> "
          f"{tokenizer.get_vocab_size() + len(merges)}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
