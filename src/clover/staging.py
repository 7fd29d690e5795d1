"""Writing a directory whole or not at all (training saves, `clover quantize`).

`staged_directory(out)` yields a fresh sibling directory to write into. When the block ends without
an error the sibling takes `out`'s place (an existing `out` is moved aside first and removed after),
with Ctrl-C deferred during the swap so it is never half done; on any exception, Ctrl-C included, the
sibling is removed and `out` is left as it was. The result gets a plain directory's permissions
(mkdtemp makes 0700, safetensors writes 0600; a model directory may ship as package data).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import threading
from pathlib import Path


@contextlib.contextmanager
def _sigint_deferred():
    """Ctrl-C inside the block takes effect when it ends, so a directory swap is never left half done."""
    if threading.current_thread() is not threading.main_thread():
        yield                   # only the main thread ever sees KeyboardInterrupt
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(*caught[0])    # the default handler raises KeyboardInterrupt


@contextlib.contextmanager
def staged_directory(out: str | Path):
    """Yield the directory to write `out`'s files into; see the module docstring."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield staging
        staging.chmod(0o755)
        for f in staging.iterdir():
            if f.is_file():
                f.chmod(0o644)
        with _sigint_deferred():
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                out.rename(old / out.name)
                staging.rename(out)
                shutil.rmtree(old)
            else:
                staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
