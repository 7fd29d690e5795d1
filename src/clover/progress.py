"""Progress bars for work that takes a while (loading, quantizing, exporting, training, evaluating).

Shown with tqdm on stderr only when stderr is a terminal: logs, pipes and CI output get nothing. One
helper so that every long loop decides the same way.
"""

from __future__ import annotations

import sys


def shown() -> bool:
    """Whether progress is drawn: stderr is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):      # (replaced or closed stderr)
        return False


def progress(iterable=None, *, total: int | None = None, desc: str | None = None, unit: str = "it",
             enabled: bool = True):
    """`iterable` wrapped in a progress bar where one is shown, else `iterable` itself. Without an
    iterable: a bar to `update(n)` by hand and `close()` (a no-op object where none is shown).
    `enabled=False` (a command's --quiet): never a bar."""
    if not (enabled and shown()):
        return iterable if iterable is not None else _NoBar()
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False,
                dynamic_ncols=True, file=sys.stderr)


def beside(bar, log):
    """`log` for lines printed while `bar` is drawn: the bar is cleared first and drawn again after."""
    if isinstance(bar, _NoBar):
        return log

    def write(line):
        bar.clear()
        log(line)
        bar.refresh()

    return write


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
