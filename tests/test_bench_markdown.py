"""Issue 45: the README's headline table is written by the benchmark that measures it
(`clover bench llama-cpp --markdown-out README.md`), into a marked block, with the machine and the command."""

from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks import llama_cpp
from benchmarks.common import machine_line, write_markdown

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = f"<!-- {llama_cpp.MARKDOWN_MARKER} -->", f"<!-- /{llama_cpp.MARKDOWN_MARKER} -->"


def test_a_marked_block_is_replaced_and_nothing_else(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(f"# Title\n\nBefore.\n\n{BEGIN}\nold table\n{END}\n\nAfter.\n")
    write_markdown(page, "| new | table |\n", llama_cpp.MARKDOWN_MARKER)
    assert page.read_text() == f"# Title\n\nBefore.\n\n{BEGIN}\n| new | table |\n{END}\n\nAfter.\n"


def test_a_file_without_markers_gets_the_table_alone(tmp_path):
    out = tmp_path / "headline.md"
    write_markdown(out, "| a |", llama_cpp.MARKDOWN_MARKER)
    assert out.read_text() == "| a |\n"


@pytest.mark.parametrize("text", [f"{END}\n{BEGIN}\n", f"{BEGIN}\n{BEGIN}\n{END}\n", f"{BEGIN}\nno end\n"])
def test_broken_markers_are_refused_and_the_file_left_alone(tmp_path, text):
    page = tmp_path / "README.md"
    page.write_text(text)
    with pytest.raises(ValueError, match="expected one"):
        write_markdown(page, "| a |", llama_cpp.MARKDOWN_MARKER)
    assert page.read_text() == text


def test_the_headline_names_machine_and_command():
    text = llama_cpp.headline("| table |", [2], ["--rounds", "3", "--markdown-out", "README.md"])
    table, machine = text.split("\n\n")
    assert table == "| table |"
    assert machine.startswith("Machine: ") and ", 2 threads, " in machine
    assert machine.endswith("Command: `clover bench llama-cpp --rounds 3 --markdown-out README.md`.")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), None)
    if cpu:
        assert cpu in machine_line(2)


def test_the_headline_leaves_out_where_the_json_went():
    """A page shows the command that measured, not a path on the machine that ran it."""
    text = llama_cpp.headline("| t |", [1], ["--rounds", "5", "--json-out", "/tmp/x.json", "--markdown-out", "R.md",
                                            "--json-out=/tmp/y.json"])
    assert text.endswith("Command: `clover bench llama-cpp --rounds 5 --markdown-out R.md`.")


def check_headline_block(page: str, engines: int = 6) -> None:
    """What the README's block must hold: the benchmark's table (at least six engines, each one the
    benchmark knows) and its machine line."""
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    block = page.split(BEGIN)[1].split(END)[0].strip().splitlines()
    header = next(line for line in block if line.startswith("| engine |"))
    assert header.split(" | ")[:5] == ["| engine", "file GB", "MB read / token", "prefill tok/s (min–max)",
                                       "decode tok/s (min–max)"]
    rows = [line for line in block if line.startswith(("| Clover", "| llama.cpp"))]
    assert len(rows) >= engines and {row.split(" | ")[0][2:] for row in rows} <= {c[0] for c in llama_cpp.CONFIGS}
    assert block[-1].startswith("Machine: ") and "Command: `clover bench llama-cpp" in block[-1]


def test_the_readme_shows_a_table_in_the_marked_block_with_its_machine():
    check_headline_block((ROOT / "README.md").read_text())


def _sample(median: float) -> dict:
    return {"median": median, "all": [median * 0.9, median, median * 1.1]}


def test_the_benchmark_writes_such_a_block(tmp_path):
    """summarize's table of a (made-up) run, written into a README-like page, passes the same check;
    its ratios are recomputed here from the medians."""
    names = [c[0] for c in llama_cpp.CONFIGS]
    speed = {name: (100.0 + 10 * i, 20.0 + i) for i, name in enumerate(names)}      # prefill, decode tok/s
    result = {name: {"prefill_tokens_per_s": _sample(p), "decode_tokens_per_s": _sample(d),
                     "decode_step_ms": {"median": 1000 / d}, "greedy_tokens": list(range(8)),
                     "peak_rss_bytes": 5e8} for name, (p, d) in speed.items()}
    rounds = [{"bandwidth": {"read_gbps": 30.0}, "results": result}]
    args = Namespace(threads=2, prompt=256, decode=8, repeats=3)
    rows, table = llama_cpp.summarize(rounds, {n: {"total": 1e8} for n in names}, {n: 5e8 for n in names},
                                      names, args)
    clover_bf16 = next(r for r in rows if r["name"] == "Clover bf16")
    assert clover_bf16["prefill_vs_llama"] == pytest.approx(speed["Clover bf16"][0] / speed["llama.cpp BF16"][0])
    page = tmp_path / "README.md"
    page.write_text(f"# Clover\n\n{BEGIN}\nold\n{END}\n")
    write_markdown(page, llama_cpp.headline(table, [args.threads], ["--rounds", "1"]), llama_cpp.MARKDOWN_MARKER)
    check_headline_block(page.read_text(), engines=len(names))


def test_thread_counts_parse_as_a_list():
    assert llama_cpp._thread_counts("2") == [2] and llama_cpp._thread_counts("1,2") == [1, 2]
    with pytest.raises(Exception, match="positive"):
        llama_cpp._thread_counts("0,2")
