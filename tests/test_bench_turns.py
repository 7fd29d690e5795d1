"""benchmarks.turns: two real processes measuring in turns (what `compare --lockstep` relies on)."""

import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks import turns

ROOT = Path(__file__).resolve().parents[1]

PARTICIPANT = textwrap.dedent("""
    import sys, time
    from benchmarks.turns import Turns
    directory, name, count, log, die_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    t = Turns(directory, name, poll_s=0.01)
    for i in range(count):
        with t.turn():
            with open(log, "a") as f:
                f.write(f"start {name}\\n")
            time.sleep(0.05)
            with open(log, "a") as f:
                f.write(f"end {name}\\n")
        if i + 1 == die_after:
            import os
            os._exit(1)                  # crash without leaving: the pid check must free the other
    t.leave()
    with open(log, "a") as f:
        f.write(f"exit {name}\\n")
""")


def _run(tmp_path, plan, first):
    """plan: {name: (turns, die_after)}; returns the names in the order their turns ran."""
    directory = turns.setup(tmp_path / "turns", [first] + [n for n in plan if n != first])
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", PARTICIPANT, str(directory), name, str(count), str(log),
                               str(die_after)], cwd=ROOT) for name, (count, die_after) in plan.items()]
    for p in procs:
        p.wait(timeout=60)
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    exits = [i for i, (kind, _) in enumerate(events) if kind == "exit"]
    assert exits == list(range(len(events) - len(exits), len(events)))   # teardown only after every turn
    events = events[:len(events) - len(exits)]
    assert len(events) == 2 * sum(c if d == 0 else d for c, d in plan.values())
    starts = events[0::2]
    ends = events[1::2]
    for (s_kind, s_name), (e_kind, e_name) in zip(starts, ends):
        assert (s_kind, e_kind) == ("start", "end") and s_name == e_name       # turns never overlap
    return [name for _, name in starts]


def test_two_processes_alternate_without_overlap(tmp_path):
    order = _run(tmp_path, {"a": (3, 0), "b": (3, 0)}, first="b")
    assert order == ["b", "a", "b", "a", "b", "a"]


def test_a_process_with_more_turns_goes_on_after_the_other_leaves(tmp_path):
    order = _run(tmp_path, {"a": (1, 0), "b": (4, 0)}, first="a")
    assert order == ["a", "b", "b", "b", "b"]


def test_a_crashed_process_does_not_keep_the_other_waiting(tmp_path):
    order = _run(tmp_path, {"a": (3, 1), "b": (3, 0)}, first="a")
    assert order == ["a", "b", "b", "b"]
