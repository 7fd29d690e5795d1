"""Runtime options (clover/options.py): one dataclass filled from arguments, then the environment, then
defaults, read once and kept; the only module that reads `CLOVER_*` variables (the server's launcher
reads its API key)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clover import options
from clover.options import Options

SRC = Path(options.__file__).parent


def test_environment_then_arguments_then_defaults():
    env = {"CLOVER_KERNELS": "0", "CLOVER_ISA": " AVX2 ", "CLOVER_DIST_TIMEOUT": "4.5",
           "CLOVER_PAGED_ATTENTION": "off", "CLOVER_FUSED_DEQUANT": "", "XDG_CACHE_HOME": "/tmp/x"}
    o = Options.from_environment(env, memory_check=False, isa=None)
    assert (o.kernels, o.isa, o.dist_timeout_s, o.paged_attention) == (False, "avx2", 4.5, "0")
    assert o.fused_dequant == "auto" and o.memory_check is False and o.cuda_graphs is True
    assert o.cache_home == "/tmp/x"
    assert Options.from_environment({}) == Options()


@pytest.mark.parametrize("variable, value, words", [
    ("CLOVER_KERNELS", "no", "CLOVER_KERNELS must be 0 or 1, not 'no'"),
    ("CLOVER_DIST_TIMEOUT", "soon", "CLOVER_DIST_TIMEOUT must be a number of seconds"),
    ("CLOVER_FUSED_DEQUANT", "maybe", "CLOVER_FUSED_DEQUANT must be auto, 1 or 0"),
])
def test_a_value_the_environment_cannot_mean_is_named(variable, value, words):
    with pytest.raises(ValueError, match=words):
        Options.from_environment({variable: value})


def test_read_once_and_kept_until_refreshed(monkeypatch):
    monkeypatch.setenv("CLOVER_CUDA_GRAPHS", "0")
    first = options.current()
    assert first.cuda_graphs is False
    monkeypatch.setenv("CLOVER_CUDA_GRAPHS", "1")
    assert options.current() is first                       # not read per call
    assert options.refresh().cuda_graphs is True and options.refresh(cuda_graphs=False).cuda_graphs is False


def test_no_other_module_reads_clover_variables():
    """Every `os.environ` / `os.getenv` read of a `CLOVER_*` name in the package is in options.py (or
    the server launcher's API key)."""
    def reads_clover(node) -> bool:
        if isinstance(node, ast.Call):          # os.environ.get("CLOVER_…"), os.getenv("CLOVER_…")
            target, args = ast.unparse(node.func), node.args
            if target not in ("os.environ.get", "os.getenv", "environ.get"):
                return False
        elif isinstance(node, ast.Subscript):   # os.environ["CLOVER_…"]
            target, args = ast.unparse(node.value), [node.slice]
            if target not in ("os.environ", "environ"):
                return False
        else:
            return False
        return bool(args) and isinstance(args[0], ast.Constant) and str(args[0].value).startswith("CLOVER_")

    readers = {str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
               if any(reads_clover(node) for node in ast.walk(ast.parse(path.read_text())))}
    readers -= {"options.py"}
    assert readers <= {"server/cli.py"}, readers
