"""Denormal flushing (clover.runtime): loading a model turns it on for the loading thread and the
threads torch starts afterwards; `flush_denormal=False` leaves IEEE denormals alone."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(2)
    import clover
    clover.load(None, flush_denormal=sys.argv[1] == "on")     # the demo model
    x = torch.full((1 << 20,), 1e-30)                          # 1e-30 * 1e-10 = 1e-40: a float32 denormal
    y = x * 1e-10                                              # large: split across torch's threads
    print(json.dumps({"zeros": int((y == 0).sum()), "n": y.numel()}))
""")


def _probe(mode):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="FTZ is an x86 flag")
def test_load_flushes_denormals_in_every_thread():
    on, off = _probe("on"), _probe("off")
    assert on["zeros"] == on["n"]          # every chunk, whichever thread computed it, flushed to 0
    assert off["zeros"] == 0               # IEEE: 1e-40 is representable as a denormal


def test_flush_denormals_toggles_this_thread():
    import torch

    from clover.runtime import flush_denormals

    if not flush_denormals(True):
        pytest.skip("no FTZ on this CPU")
    try:
        assert float(torch.tensor([1e-30]) * 1e-10) == 0.0
        flush_denormals(False)
        assert float(torch.tensor([1e-30]) * 1e-10) == pytest.approx(1e-40, rel=1e-3)
    finally:
        flush_denormals(True)


def test_release_free_memory_returns_heap_to_the_os():
    """What loading leaves behind: glibc raises its mmap threshold after the first large free, so the
    next mid-sized tensors come from the heap, and freeing them (with a live block above) keeps their
    pages resident; `release_free_memory` hands them back. In a fresh interpreter for a known heap."""
    script = textwrap.dedent("""
        import gc, torch, psutil
        from clover.runtime import release_free_memory
        rss = lambda: psutil.Process().memory_info().rss
        first = torch.ones((8 << 20) // 4); del first               # raises the mmap threshold to 8 MB
        blocks, pins = [], []
        for _ in range(64):                                         # 256 MB from the heap, each 4 MB
            blocks.append(torch.ones((4 << 20) // 4))               # between two live 1 MB blocks, so
            pins.append(torch.ones((1 << 20) // 4))                 # free() can neither merge nor trim it
        del blocks; gc.collect()
        before = rss()
        ok = release_free_memory()
        print(ok, before - rss())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ok, released = out.stdout.split()
    if ok != "True":
        pytest.skip("no glibc malloc_trim here")
    assert int(released) > 128 << 20
