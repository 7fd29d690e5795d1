"""Writing a directory whole or not at all (`clover quantize`, `clover export`, `save_checkpoint`,
training saves).

`staged_directory(out)` yields a fresh sibling directory, `.NAME.partial-PID-XXXX` in `out`'s parent
(the same file system, so the final rename is atomic), to write into. When the block ends without an
error, every file in it is flushed to disk (fsync: a power cut after the rename cannot leave a named
but empty file), and it takes `out`'s place in one rename — where Linux offers `renameat2`'s
RENAME_EXCHANGE, an existing `out` is swapped in the same step, so `out` is at every instant either
the old output or the new one; elsewhere the old one is moved aside first, leaving `out` absent for
the moment between two renames. Ctrl-C is deferred during the swap. On any exception, Ctrl-C
included, the sibling is removed and `out` is left as it was.

A SIGKILL or a power cut cannot run that cleanup: what it leaves is a `.NAME.partial-PID-…` sibling
(hidden, never at `out`'s path, so nothing loads it as the output), which the next staged write of the
same `out` removes once process PID is gone.

`keep(name)`, if given, names entries of an existing `out` that carry over into the new directory
(hard-linked, not copied): `save_checkpoint` replaces the weights and config of a directory that
also holds a tokenizer. The result gets a plain directory's permissions (mkdtemp makes 0700,
safetensors writes 0600; a model directory may ship as package data).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

RENAME_EXCHANGE = 2     # linux/fs.h


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


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the staging siblings of `out` that killed writers left (their process is gone); returns them."""
    pattern = re.compile(re.escape(_staging_prefix(out)) + r"(\d+)-")
    removed = []
    for sibling in out.parent.glob(_staging_prefix(out) + "*"):
        match = pattern.match(sibling.name)
        if match and sibling.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's live process
        return True
    return True


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` (itself included) to disk."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap paths `a` and `b` in one atomic step (Linux renameat2); False where that is not offered."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    AT_FDCWD = -100
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):   # EINVAL, ENOSYS, EOPNOTSUPP: not on this kernel or file system
        return False
    raise OSError(errno, os.strerror(errno), str(b))


def _carry_over(out: Path, staging: Path, keep) -> None:
    """Hard-link the entries of `out` that `keep` names into `staging` (copies where links fail)."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for entry in out.iterdir():
        if not keep(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / entry.name, copy_function=link, symlinks=True)
        else:
            link(entry, staging / entry.name)


@contextlib.contextmanager
def staged_directory(out: str | Path, keep=None):
    """Yield the directory to write `out`'s files into; see the module docstring."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory: refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    staging = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(out)}{os.getpid()}-", dir=out.parent))
    try:
        if keep is not None and out.is_dir():
            _carry_over(out, staging, keep)
        yield staging
        staging.chmod(0o755)
        for f in staging.iterdir():
            if f.is_file():
                f.chmod(0o644)
        _fsync_tree(staging)
        with _sigint_deferred():
            if not out.exists():
                staging.rename(out)
            elif _exchange(staging, out):
                _remove(staging)                # (now the old output)
            else:
                old = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(out)}{os.getpid()}-old-", dir=out.parent))
                out.rename(old / out.name)
                staging.rename(out)
                shutil.rmtree(old)
            _fsync_dir(out.parent)
    finally:
        if os.path.lexists(staging):
            _remove(staging)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
