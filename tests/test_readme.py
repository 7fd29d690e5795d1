"""Issue 25: the README's code blocks run as shown. The Quick start block is run literally, in order,
in a fresh virtualenv by CI (.ci/run, whose last Quick start line is the test suite itself; checked
here to be the README's block); its install lines are checked against pyproject.toml here, its
generate command, the library snippet, and the serving example (the server command and the OpenAI
client code against it) are run as written, only the port swapped for a free one."""

from __future__ import annotations

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
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n## ", start + 1)
    nxt = README.find("\n### ", start + 1)
    return README[start: min(e for e in (end, nxt, len(README)) if e > 0)]


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
    guard = "command -v chromium || (apt-get update && apt-get install -y chromium chromium-driver)"
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
    snippet = next(b for b in blocks("python") if "clover.load()" in b)
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=ENV, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "tokens_per_forward" in out.stdout


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
    (serve_line,) = commands(re.search(r"```bash\n(.*?)```", section("### Serving (OpenAI-compatible)"), re.S).group(1))
    return serve_line


def test_serving_example_runs_as_shown():
    serving = section("### Serving (OpenAI-compatible)")
    client_code = re.search(r"```python\n(.*?)```", serving, re.S).group(1)
    assert _run_against_server(_serve_line(), client_code).strip()


def test_agent_example_runs_as_shown():
    """The Tools section's agent loop against its server: the tool-trained demo model calls multiply,
    reads the result and answers with it (23 × 41 = 943, by hand)."""
    tools = section("#### Tools")
    (serve_line,) = commands(re.search(r"```bash\n(.*?)```", tools, re.S).group(1))
    agent = next(b for b in blocks("python") if "run_tool" in b and "while True" in b)
    out = _run_against_server(serve_line, agent)
    assert out.strip().splitlines()[-1] == "943", out


def test_readme_and_docs_stay_inside_the_repository():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        assert "../shared" not in text and "issue #" not in text, path
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://")):
                assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
