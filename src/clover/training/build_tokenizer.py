"""Build the demo tokenizer: byte-level BPE trained on generated task chats, saved for transformers.

Special tokens take ids 0-5 (SPEC §11); digits are always split one per token so the model does
arithmetic digit by digit; every byte is in the base alphabet, so any text round-trips.
Usage: `python -m clover.training.build_tokenizer OUT_DIR [--vocab-size 512] [--seed 0]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from clover.tokenization import CHAT_TEMPLATE, ENDOFTEXT, IM_END, MASK, SPECIAL_TOKENS
from clover.training.tasks import TASK_NAMES, generate_example

# Plain text beyond the tasks so common chat words get merges too.
_EXTRA_TEXT = [
    "You are a helpful assistant.", "Hello! How can I help you today?", "Thank you, that is correct.",
    "The answer is", "Let me think about this step by step.", "I am not sure, but here is my best guess.",
    "Sure, here is what you asked for.", "Could you please explain that again?", "Good morning, good evening.",
]


def training_corpus(n_examples: int = 4000, seed: int = 0) -> list[str]:
    """Chats of every task, rendered through the template with thinking on and off, cut at the
    special tokens: encoding splits them out before BPE, so merges must not learn their pieces."""
    rng = random.Random(seed)
    specials = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    texts = list(_EXTRA_TEXT)
    for i in range(n_examples):
        ex = generate_example(TASK_NAMES[i % len(TASK_NAMES)], rng)
        think = (i // len(TASK_NAMES)) % 2 == 0  # every task in both modes
        texts.extend(t for t in specials.split(ex.prompt_text(think) + ex.completion_text(think)) if t)
    return texts


def build_tokenizer(out_dir: str, vocab_size: int = 512, seed: int = 0,
                    model_max_length: int = 4096) -> Tokenizer:
    """Train, save (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`), return."""
    tok = Tokenizer(models.BPE())
    # Newlines are isolated so "\n\n" never becomes one token: then a prompt ending in newlines
    # tokenizes the same alone as followed by its completion (train = inference boundary).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    extra = [t for t in SPECIAL_TOKENS if t not in (ENDOFTEXT, IM_END, MASK)]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "mask_token": MASK,
        "additional_special_tokens": extra,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "mask_token": MASK,
                   "additional_special_tokens": extra}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return tok


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tok = build_tokenizer(args.out_dir, args.vocab_size, args.seed)
    print(f"wrote {args.out_dir}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
