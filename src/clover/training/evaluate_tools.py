"""Tool-call accuracy of the demo model on held-out tool problems (`clover eval-demo --tools`).

Per decoding mode (evaluate.MODES) and tool, with all of DEMO_TOOLS offered in their documented order
(what docs/tools.md's agent example sends):
  - `call`: the first turn's output holds exactly one call, to the right tool, with arguments equal
    to the expected ones once typed by the tool's schema (the server's own parser reads it);
  - `answer`: given the right call and the tool's true result, the second turn's answer is exact;
  - `end_to_end`: both (what an agent loop needs);
and, for the evaluated tasks' questions with the tools offered (`no_call`), that the model answers
without calling a tool, correctly. `call_grammar` (the server's default under tool_choice "auto"):
each response follows the call grammar of the offered tools, as `clover serve` builds it.
"""

from __future__ import annotations

import json
import random
import time

from ..generation.api import generate_batch, resolve_settings
from ..progress import progress as progress_bar
from ..server.tool_calls import parse_tool_calls
from ..tokenization import THINK_END, CloverTokenizer
from .evaluate import MODES
from .tasks import TASK_NAMES, Example, check_answer, sample_examples, split_of
from .tool_tasks import DEMO_TOOLS, TOOL_TASK_NAMES, demo_store_value, tool_problem

TOOL_METRICS = ("call", "answer", "end_to_end")


def heldout_tool_problems(per_task: int, seed: int = 1234) -> list[tuple[str, Example, Example, dict]]:
    """`per_task` held-out problems per tool: (task, call turn, answer turn, expected call)."""
    rng = random.Random(seed)
    out = []
    for task in TOOL_TASK_NAMES:
        found = 0
        while found < per_task:
            state = rng.getstate()
            call, _, expected = tool_problem(task, rng, tools=DEMO_TOOLS)
            if split_of(call) != "heldout":
                continue
            result = (str(demo_store_value(expected["arguments"]["key"])) if expected["name"] == "lookup"
                      else None)
            rng.setstate(state)     # the same problem again, now with its true result
            call, reply, expected = tool_problem(task, rng, tools=DEMO_TOOLS, result=result)
            out.append((task, call, reply, expected))
            found += 1
    return out


def _content(text: str) -> str:
    return text.rsplit(THINK_END, 1)[-1]


def call_matches(text: str, expected: dict) -> bool:
    """One call in `text`'s answer, naming the expected tool with exactly the expected arguments."""
    _, calls = parse_tool_calls(_content(text), DEMO_TOOLS)
    if len(calls) != 1 or calls[0]["function"]["name"] != expected["name"]:
        return False
    try:
        args = json.loads(calls[0]["function"]["arguments"] or "{}")
    except ValueError:
        return False
    return args == expected["arguments"]


def evaluate_tools(model, tokenizer: CloverTokenizer, per_task: int = 20, seed: int = 1234, modes=None,
                   enable_thinking: bool = True, max_new_tokens: int = 128, batch_size: int = 32,
                   progress=None, call_grammar: bool = True) -> dict:
    """{mode: {tool task: {call, answer, end_to_end, n}, "no_call": {accuracy, n},
    "_all": {…}, "tokens_per_forward": x, "seconds": s}}."""
    problems = heldout_tool_problems(per_task, seed)
    plain = []
    for task in TASK_NAMES:
        for ex in sample_examples(max(1, per_task // 2), "heldout", seed, tasks=[task]):
            plain.append(Example(ex.task, ex.messages, ex.thinking, ex.answer, ex.key, tools=tuple(DEMO_TOOLS)))
    prompts = ([tokenizer.encode(c.prompt_text(enable_thinking)) for _, c, _, _ in problems]
               + [tokenizer.encode(r.prompt_text(enable_thinking)) for _, _, r, _ in problems]
               + [tokenizer.encode(ex.prompt_text(enable_thinking)) for ex in plain])
    modes = modes if isinstance(modes, dict) else {m: MODES[m] for m in (modes or MODES)}
    n = len(problems)
    report = {}
    for mode, mode_settings in modes.items():
        settings = resolve_settings(model, max_new_tokens=max_new_tokens, **mode_settings)
        results, start = [], time.perf_counter()
        with progress_bar(total=len(prompts), desc=mode, unit="prompt") as bar:
            for i in range(0, len(prompts), batch_size):
                batch = prompts[i : i + batch_size]
                grammars = [_call_matcher(tokenizer, model, settings, enable_thinking) for _ in batch] if call_grammar else None
                results += generate_batch(model, batch, settings, grammars=grammars)
                bar.update(len(batch))
        seconds = time.perf_counter() - start
        texts = [tokenizer.decode(r.tokens) for r in results]
        per: dict = {}
        for task in (*TOOL_TASK_NAMES, "_all"):
            idx = [i for i, p in enumerate(problems) if task in ("_all", p[0])]
            call_ok = [call_matches(texts[i], problems[i][3]) for i in idx]
            answer_ok = [check_answer(problems[i][2], texts[n + i]) for i in idx]
            per[task] = {"call": sum(call_ok) / len(idx), "answer": sum(answer_ok) / len(idx),
                         "end_to_end": sum(a and b for a, b in zip(call_ok, answer_ok)) / len(idx), "n": len(idx)}
        no_call = [not parse_tool_calls(_content(texts[2 * n + j]), DEMO_TOOLS)[1] and check_answer(ex, texts[2 * n + j])
                   for j, ex in enumerate(plain)]
        per["no_call"] = {"accuracy": sum(no_call) / len(plain), "n": len(plain)}
        tokens = sum(r.stats.generated_tokens for r in results)
        per["tokens_per_forward"] = tokens / max(1, sum(r.stats.forwards for r in results))
        per["seconds"] = seconds
        report[mode] = per
        if progress:
            progress(f"{mode}: end-to-end {per['_all']['end_to_end']:.1%}, call {per['_all']['call']:.1%}, "
                     f"no-call {per['no_call']['accuracy']:.1%}, {per['tokens_per_forward']:.2f} tokens/forward")
    return report


def _call_matcher(tokenizer: CloverTokenizer, model, settings, thinking: bool):
    """A matcher for the demo tools' call grammar under tool_choice "auto", as the server builds it."""
    from ..grammar import Grammars
    from ..server.structured import auto_lark

    key = (tuple(settings.eos_token_id), thinking)
    cache = _call_matcher.__dict__.setdefault("cache", {})
    if key not in cache:
        grammars = Grammars(tokenizer.tokenizer, model.config.vocab_size, settings.eos_token_id,
                            tokenizer.think_end_token_id)
        think_end = tokenizer.think_end_token_id if thinking else None
        cache[key] = (grammars, grammars.compile(auto_lark(list(DEMO_TOOLS), True, think_end)))
    grammars, lark = cache[key]
    return grammars.matcher(lark)


def format_tool_report(report: dict) -> str:
    """One row per tool (+ all, + no-call), one `call / answer / end-to-end` cell per mode."""
    modes = list(report)
    lines = [f"{'tool':<14}" + "".join(f"{m:>28}" for m in modes),
             " " * 14 + "".join(f"{'call  answer  both':>28}" for _ in modes)]
    for task in (*TOOL_TASK_NAMES, "_all"):
        name = "all" if task == "_all" else task.removeprefix("tool_")
        cells = "".join(f"{report[m][task]['call'] * 100:>14.0f}% {report[m][task]['answer'] * 100:>5.0f}% "
                        f"{report[m][task]['end_to_end'] * 100:>5.0f}%" for m in modes)
        lines.append(f"{name:<14}{cells}")
    lines.append(f"{'no call':<14}" + "".join(f"{report[m]['no_call']['accuracy'] * 100:>27.0f}%" for m in modes))
    lines.append(f"{'tok/forward':<14}" + "".join(f"{report[m]['tokens_per_forward']:>28.2f}" for m in modes))
    return "\n".join(lines)
