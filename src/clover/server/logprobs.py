"""`logprobs` / `top_logprobs` / `echo`: what a request asks for, and the OpenAI response shapes.

The numbers come from `Engine.score` (generation/scoring.py): one causal forward over [prompt |
completion] after the completion is written, so they are the model's causal next-token
log-probabilities whatever the decoding mode — for autoregressive and self-speculative output the
distribution each token was chosen from (raw: before temperature, top-k/p and dllm_* controls), for
LowConfidence output the causal mode's log-probability of the token the block decoder wrote (not the
block step's fill confidence). That scoring needs the whole completion, so these fields do not
combine with `stream` (nor does `echo`, not implemented for streams). The entries cover exactly the
tokens counted in `usage.completion_tokens`: an ending end-of-turn token included, and with a stop
string up to the token that completed it.

Token strings are the token's bytes as UTF-8, or `bytes:\\xNN…` when they are not valid UTF-8 on
their own (part of a character), as OpenAI writes them.
"""

from __future__ import annotations

from ..tokenization import CloverTokenizer, IncrementalDecoder
from .protocol import ChatRequest, CompletionRequest, bad_request

MAX_TOP_LOGPROBS = 20          # OpenAI chat's limit (vLLM's default max_logprobs too)


def completion_top_k(req: CompletionRequest) -> int | None:
    """`logprobs` of a /v1/completions request: None (not asked) or the number of top tokens."""
    if req.stream and req.logprobs is not None:
        raise bad_request("logprobs does not combine with stream: true (log-probabilities are scored once the "
                          "completion is written)", "logprobs", "unsupported")
    if req.stream and req.echo:
        raise bad_request("echo does not combine with stream: true", "echo", "unsupported")
    if req.logprobs is None:
        return None
    if not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must lie in 0..{MAX_TOP_LOGPROBS}, got {req.logprobs}", "logprobs",
                          "invalid_value")
    return req.logprobs


def chat_top_k(req: ChatRequest) -> int | None:
    """`logprobs` / `top_logprobs` of a chat request: None (not asked) or the number of top tokens."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    if not req.logprobs:
        return None
    if req.stream:
        raise bad_request("logprobs does not combine with stream: true (log-probabilities are scored once the "
                          "completion is written)", "logprobs", "unsupported")
    k = req.top_logprobs or 0
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must lie in 0..{MAX_TOP_LOGPROBS}, got {k}", "top_logprobs",
                          "invalid_value")
    return k


def token_text(tokenizer: CloverTokenizer, token_id: int) -> str:
    data = token_bytes(tokenizer, token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def token_bytes(tokenizer: CloverTokenizer, token_id: int) -> bytes:
    try:
        return tokenizer.token_bytes(token_id)
    except ValueError:             # an id of the model's padded vocabulary that the tokenizer lacks
        return b""


def text_offsets(tokenizer: CloverTokenizer, ids: list[int], skip_special_tokens: bool, skip_ids=()) -> list[int]:
    """Where each token's text starts in the decoded text of `ids` (characters; a token ending inside
    a character starts where that character will; `skip_ids` add no text)."""
    decoder, offsets, n = IncrementalDecoder(tokenizer, skip_special_tokens), [], 0
    skip = set(skip_ids)
    for t in ids:
        offsets.append(n)
        if t not in skip and 0 <= t < tokenizer.vocab_size:
            n += len(decoder.feed(t))
    return offsets


def completion_logprobs(tokenizer: CloverTokenizer, prompt_ids: list[int], completion: list[int], scores, *,
                        echo: bool, content: str = "", skip_special_tokens: bool = True, eos_ids=()) -> dict:
    """The /v1/completions `logprobs` object: over the prompt too with `echo` (then `text` is the
    decoded prompt followed by `content`), text offsets into that text."""
    offsets, base = [], 0
    if echo:
        offsets = text_offsets(tokenizer, prompt_ids, False)
        base = len(tokenizer.decode(prompt_ids))
    offsets += [base + min(o, len(content))
                for o in text_offsets(tokenizer, completion, skip_special_tokens, eos_ids)]
    return legacy_logprobs(tokenizer, prompt_ids + list(completion), scores, 0 if echo else len(prompt_ids), offsets)


def legacy_logprobs(tokenizer: CloverTokenizer, ids: list[int], scores, first: int, offsets: list[int]) -> dict:
    """The /v1/completions `logprobs` object for `ids[first:]`. `scores` scored all of `ids`
    (`scores.*[i - 1]` is about ids[i]); position 0 has no prediction, so its entries are null."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for i in range(first, len(ids)):
        out["tokens"].append(token_text(tokenizer, ids[i]))
        if i == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(scores.token_logprobs[i - 1])
        out["top_logprobs"].append({token_text(tokenizer, t): lp for t, lp in scores.top[i - 1]})
    return out


def chat_logprobs(tokenizer: CloverTokenizer, ids: list[int], scores, first: int) -> dict:
    """The chat `logprobs` object ({"content": [...], "refusal": null}) for `ids[first:]`, first >= 1."""
    def entry(t: int, lp: float) -> dict:
        return {"token": token_text(tokenizer, t), "logprob": lp, "bytes": list(token_bytes(tokenizer, t))}

    content = [dict(entry(ids[i], scores.token_logprobs[i - 1]),
                    top_logprobs=[entry(t, lp) for t, lp in scores.top[i - 1]]) for i in range(first, len(ids))]
    return {"content": content, "refusal": None}
