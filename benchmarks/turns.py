"""Two benchmark processes, both loaded, measuring in turns (`compare --lockstep`).

This machine's speed drifts by 10–40% over minutes. Run one engine's whole benchmark after the other's
and each ratio pairs measurements one to two and a half minutes apart (full bench model), the second
engine loading right after the first has freed its model. With both processes resident, each
measurement (a model load, a prefill length, a decode run, a block setting) is a turn: only one
process measures at a time, the other waits blocked on a file lock (no CPU), and turns alternate
while both are still measuring, so the same operation of the two engines runs seconds apart (7–53 s
on the full bench model) and no process loads or exits while the other measures. (It narrows the
pairing; the machine's noise within seconds remains: README, Performance.)

Protocol, all state in one directory: `lock` (flock held for the whole turn) and `state.json` (who
measured last; who takes part, by name, and their pids once started). A process may start a turn when
the last turn was not its own, or when no other participant is left. A process done measuring waits
for the others to finish before it tears down (freeing a model is seconds of CPU). The driver lists the
participants before starting them (so the first to load cannot run ahead of one not yet started) and
calls `leave` for each as it exits, cleanly or not; a participant whose pid is gone counts as left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path


def _alive(pid) -> bool:
    if pid is None:
        return True                       # listed by the driver, not started yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(directory: Path):
    with open(directory / "lock", "a+") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _read(directory: Path) -> dict:
    path = directory / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"last": None, "members": {}}


def _write(directory: Path, state: dict) -> None:
    tmp = directory / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, directory / "state.json")


def setup(directory, names) -> Path:
    """Driver side: a fresh turn directory listing `names` as participants (not started yet); names[0]
    takes the first turn, whichever process reaches the lock first."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        _write(directory, {"last": names[-1] if len(names) > 1 else None,
                           "members": {name: None for name in names}})
    return directory


def leave(directory, name: str) -> None:
    """A participant is done (called by the participant, and by the driver when it exits)."""
    directory = Path(directory)
    with _locked(directory):
        state = _read(directory)
        state["members"].pop(name, None)
        _write(directory, state)


class Turns:
    """One participant's side. Without a directory every turn is granted at once (a lone run)."""

    def __init__(self, directory, name: str, poll_s: float = 0.1):
        self.directory = Path(directory) if directory else None
        self.name = name
        self.poll_s = poll_s
        if self.directory:
            with _locked(self.directory):
                state = _read(self.directory)
                state["members"][name] = os.getpid()
                _write(self.directory, state)

    @contextlib.contextmanager
    def turn(self):
        """Measure inside this block: it starts once the other participant has had its turn (or left)
        and holds the lock until it ends."""
        if self.directory is None:
            yield
            return
        while True:
            with _locked(self.directory):
                state = _read(self.directory)
                others = [n for n, pid in state["members"].items() if n != self.name and _alive(pid)]
                if state["last"] != self.name or not others:
                    state["last"] = self.name
                    _write(self.directory, state)
                    yield
                    return
            time.sleep(self.poll_s)

    def leave(self) -> None:
        """Done measuring: give up the turns, then wait (asleep) until the others are done too, so this
        process's teardown (seconds of CPU for freeing a model and exiting) never lands in their
        measurements."""
        if self.directory is None:
            return
        leave(self.directory, self.name)
        while True:
            with _locked(self.directory):
                state = _read(self.directory)
            if not any(_alive(pid) for n, pid in state["members"].items() if n != self.name):
                return
            time.sleep(max(self.poll_s, 0.2))
