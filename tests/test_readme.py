"""Issues 25 and 45: the README's and docs' code blocks run as shown, and their links and commands hold.
The Quick start block is run literally, in order, in a fresh virtualenv by CI (.ci/run, whose last
Quick start line is the test suite itself; checked here to be the README's block); its install lines
are checked against pyproject.toml here, its generate command, the library snippet (docs/library.md),
and the serving examples (the README's server command and OpenAI client code, docs/tools.md's agent
loop) are run as written, only the port swapped for a free one. Every relative link in README.md and
docs/*.md resolves (file and #anchor), and every `clover …` command line in their code blocks is
accepted by the argparse parser of its sub-command."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

try:
    import tomllib                      # Python >= 3.11
except ImportError:                     # 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))


def doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def section(title: str, text: str = README) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    nxt = text.find("\n### ", start + 1)
    return text[start: min(e for e in (end, nxt, len(text)) if e > 0)]


def commands(block: str) -> list[str]:
    """The block's command lines, comments stripped."""
    out = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def quick_start() -> list[str]:
    return commands(re.search(r"```bash\n(.*?)```", section("## Quick start"), re.S).group(1))


def test_quick_start_installs_what_its_later_commands_need():
    lines = quick_start()
    torch_line = next(i for i, c in enumerate(lines) if "pip install" in c and "torch" in c)
    install = next(i for i, c in enumerate(lines) if "pip install -e" in c)
    test = next(i for i, c in enumerate(lines) if "pytest" in c)
    assert "download.pytorch.org/whl/cpu" in lines[torch_line] and torch_line < install < test
    extras = re.search(r'"\.\[([^\]]*)\]"', lines[install]).group(1).split(",")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    assert set(extras) <= set(declared)
    wanted = {re.split(r"[<>=\[ ]", d)[0] for e in extras for d in declared[e]}
    assert {"pytest", "fastapi", "uvicorn", "openai", "httpx", "transformers", "hypothesis", "selenium"} <= wanted


def test_ci_installs_chromium_before_the_quick_start():
    """The playground's browser test needs Debian's chromium + chromium-driver: .ci/run installs them
    when missing, before the Quick start's suite runs."""
    ci = (ROOT / ".ci" / "run").read_text()
    guard = "command -v chromium || (apt-get update -q && apt-get install -y -q chromium chromium-driver)"
    assert guard in ci and ci.index(guard) < ci.index('bash -e -c "$quick_start"')


def test_ci_runs_the_quick_start_block_as_written():
    """.ci/run runs the block itself (in a fresh .venv, as its first step); here: it is this block."""
    block = re.search(r"```bash\n(.*?)```", section("## Quick start"), re.S).group(1)
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-quick-start"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == block and commands(out.stdout) == quick_start()
    assert quick_start()[-1] == "python -m pytest -q tests"     # so CI's suite is the Quick start's last line


def test_ci_runs_every_test_file_that_needs_the_eval_extra():
    """The Quick start installs no [eval]; .ci/run adds it and runs the test files that skip without it."""
    ci = (ROOT / ".ci" / "run").read_text()
    listed = set(re.search(r"EVAL_TESTS=\(([^)]*)\)", ci).group(1).split())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    eval_modules = {re.split(r"[<>=\[ ]", d)[0].replace("-", "_") for d in project["optional-dependencies"]["eval"]}
    needing = {f"tests/{p.name}" for p in sorted((ROOT / "tests").glob("test_*.py"))
               if any(f'importorskip("{m}")' in p.read_text() for m in eval_modules)}
    assert needing and listed == needing


def test_quick_start_generate_runs_as_written():
    (line,) = [c for c in quick_start() if c.startswith("clover generate")]
    argv = [sys.executable, "-m", "clover"] + shlex.split(line)[1:]
    out = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "42" in out.stdout and "tokens/forward" in out.stderr


def test_using_it_snippet_runs():
    snippet = next(b for b in blocks("python", doc("library.md")) if "clover.load()" in b)
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=ENV, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "tokens_per_forward" in out.stdout


def test_text_api_snippets_run():
    readme = next(b for b in blocks("python") if "clover.LLM()" in b)
    library = next(b for b in blocks("python", doc("library.md")) if "clover.LLM()" in b)
    for snippet in (readme, library):
        out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=ENV, timeout=300,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), snippet


def _run_against_server(serve_line: str, client_code: str) -> str:
    """Start `serve_line` (the README's server command) on a free port, run `client_code` against it
    with the port swapped in, return its stdout."""
    assert "--port 8000" in serve_line and ":8000/" in client_code
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    argv = [sys.executable, "-m", "clover"] + shlex.split(serve_line.replace("--port 8000", f"--port {port}"))[1:]
    proc = subprocess.Popen(argv + ["--threads", "1", "--log-level", "warning"], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        out = subprocess.run([sys.executable, "-c", client_code.replace(":8000/", f":{port}/")], capture_output=True,
                             text=True, env=ENV, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout
    finally:
        proc.terminate()
        proc.wait(60)


def _serve_line() -> str:
    (serve_line,) = commands(re.search(r"```bash\n(.*?)```", section(SERVE_SECTION), re.S).group(1))
    return serve_line


SERVE_SECTION = "## Serve (OpenAI API, tools, structured output)"


def test_serving_example_runs_as_shown():
    serving = section(SERVE_SECTION)
    client_code = re.search(r"```python\n(.*?)```", serving, re.S).group(1)
    assert _run_against_server(_serve_line(), client_code).strip()


def test_agent_example_runs_as_shown():
    """docs/tools.md's agent loop against its server: the tool-trained demo model calls multiply,
    reads the result and answers with it (23 × 41 = 943, by hand)."""
    tools = section("## An agent loop on the demo model", doc("tools.md"))
    (serve_line,) = commands(re.search(r"```bash\n(.*?)```", tools, re.S).group(1))
    agent = next(b for b in blocks("python", tools) if "run_tool" in b and "while True" in b)
    out = _run_against_server(serve_line, agent)
    assert out.strip().splitlines()[-1] == "943", out


def test_readme_and_docs_stay_inside_the_repository():
    for path in PAGES:
        text = path.read_text()
        assert "../shared" not in text and "issue #" not in text, path


def test_readme_is_a_front_page():
    """A page people read, not the manual: at most 250 lines, every use linking to its docs page."""
    assert len(README.splitlines()) <= 250
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", README))
    assert {p.name for p in PAGES[1:]} - {"PYPI.md"} <= linked


FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but '-' and '_' dropped, spaces → '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), re.M):
        base = slug(heading)
        seen[base if base not in seen else f"{base}-{seen[base]}"] = 0
        seen[base] = seen.get(base, 0) + 1
    return set(seen)


def test_slug_matches_github_on_hand_checked_headings():
    assert slug("11. Tokens and chat template") == "11-tokens-and-chat-template"
    assert slug("Loading (`clover.load`)") == "loading-cloverload"
    assert slug("Against llama.cpp on the full-size Q4_K_M file") == "against-llamacpp-on-the-full-size-q4_k_m-file"


def test_every_relative_link_resolves(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title\n## A title\n```bash\n# not a heading\n```\n")
    assert anchors(page) == {"a-title", "a-title-1"}
    broken = []
    for path in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", path.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file) if file else path
            if not resolved.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(resolved):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def clover_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every `clover …`, `python -m clover …` or `torchrun … -m clover …` line in the
    shell blocks of README.md and docs/*.md, continuation lines joined, each command of a `&&` /
    `;` / `|` chain on its own."""
    found = []
    for path in PAGES:
        for lang, block in FENCE.findall(path.read_text()):
            if lang not in ("", "bash", "sh", "console"):
                continue
            for line in block.replace("\\\n", " ").splitlines():
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split, lexer.commenters = True, "#"
                command: list[str] = []
                for token in [*lexer, ";"]:
                    if token.strip("&;|<>") or not token:
                        command.append(token)
                        continue
                    words = [w for w in command if not re.match(r"^[A-Z_]+=", w)] if command else []
                    if words[:1] == ["clover"]:
                        found.append((path.name, words[1:]))
                    elif "clover" in words and words[words.index("clover") - 1] == "-m":
                        found.append((path.name, words[words.index("clover") + 1:]))
                    command = []
    return found


class _Parsed(Exception):
    """Raised in place of running a command once its parser accepted the arguments."""


def test_clover_commands_in_the_docs_parse(monkeypatch, capsys):
    from clover import cli

    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "path", list(sys.path))           # `clover bench` adds the checkout
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    found = clover_commands()
    assert len(found) > 40 and {argv[0] for _, argv in found} >= {"generate", "serve", "quantize", "bench", "train"}
    refused = []
    for page, argv in found:
        if argv[0] == "lm-eval" and importlib.util.find_spec("lm_eval") is None:
            continue                    # lm-eval's own parser; checked where the eval extra is installed
        try:
            status = cli.main(argv)
        except _Parsed:
            continue
        except SystemExit as exc:
            status = exc.code
        if status:
            refused.append(f"{page}: clover {shlex.join(argv)}: {capsys.readouterr().err.strip()[-300:]}")
    assert not refused, "\n".join(refused)


def test_clover_command_check_catches_an_unknown_flag(monkeypatch, capsys):
    """The check above is not vacuous: a flag the sub-command does not define is refused."""
    from clover import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["quantize", "SRC", "DST", "--bits", "4", "--no-such-flag"])
    assert exc.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
