"""Shared pytest setup: tiny models are overhead-bound, so one intra-op thread is fastest and steadiest."""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tiny models (intra-op threads fighting for two shared cores
    make tiny forwards far slower), restored afterwards for modules that set their own."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_options(monkeypatch):
    """Each test reads the runtime options (clover/options.py) from its own environment on first use;
    a test that changes the environment later calls `options.refresh()`."""
    from clover import options

    monkeypatch.setattr(options, "_current", None)


@pytest.fixture
def set_options(monkeypatch):
    """`set_options(name=value, …)`: runtime options in force for this test only."""
    import dataclasses

    from clover import options

    def apply(**changes):
        monkeypatch.setattr(options, "_current", dataclasses.replace(options.current(), **changes))
    return apply


@pytest.fixture
def setenv(monkeypatch):
    """`setenv(name, value)`: an environment variable for this test, the runtime options read again."""
    from clover import options

    def apply(name, value):
        monkeypatch.setenv(name, value)
        options.refresh()
    return apply


@pytest.fixture(params=["gathered", "paged"])
def attention_path(request, set_options):
    """The "cuda" backend's attention over keys gathered from the pages, or over the pages in place
    (clover/gpu/paged_attention.py; uncompiled FlexAttention on CPU: its masks, not its kernels)."""
    set_options(paged_attention="1" if request.param == "paged" else "0")
    return request.param
