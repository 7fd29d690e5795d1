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


@pytest.fixture(params=["gathered", "paged"])
def attention_path(request, monkeypatch):
    """The "cuda" backend's attention over keys gathered from the pages, or over the pages in place
    (clover/gpu/paged_attention.py; uncompiled FlexAttention on CPU: its masks, not its kernels)."""
    from clover.gpu import paged_attention

    monkeypatch.setattr(paged_attention, "MODE", "1" if request.param == "paged" else "0")
    return request.param
