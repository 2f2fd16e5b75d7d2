"""The chaos suite's machinery: a seeded fault schedule (which fault, at which update, on which
process) and the invariants every run under faults must keep (tests/test_chaos.py)."""

from __future__ import annotations

import glob
import json
import os
import signal
import time
import zlib

import numpy as np
from run_files import metric_rows, trained_episodes

from rl.checkpoint import load_groups

DEFAULT_SEED = 18  # CI runs this schedule; CHAOS_SEED=<n> replays (or explores) another


class Schedule:
    """Seeded choices for one test: draw() picks an update (or slot, or delay) from the seed and
    the test's name, and records it; str() is the whole schedule, printed at the start so a
    failing run's output says how to replay it."""

    def __init__(self, test: str, seed: int | None = None):
        self.seed = int(os.environ.get("CHAOS_SEED", DEFAULT_SEED)) if seed is None else seed
        self.test = test
        self.rng = np.random.default_rng([self.seed, zlib.crc32(test.encode())])
        self.picks: dict[str, float] = {}

    def draw(self, name: str, lo: int, hi: int) -> int:
        """An integer in [lo, hi], drawn from the seed and recorded under `name`."""
        v = int(self.rng.integers(lo, hi + 1))
        self.picks[name] = v
        return v

    def __str__(self) -> str:
        picks = ", ".join(f"{k}={v}" for k, v in self.picks.items())
        return f"chaos seed {self.seed} ({self.test}): {picks}; replay with CHAOS_SEED={self.seed}"


class Faults:
    """The log of injected faults: when each landed (monotonic), so the recovery that follows
    can be timed against the deadline that bounds it."""

    def __init__(self):
        self.at: dict[str, float] = {}
        self.recovered: dict[str, float] = {}
        self.pids: dict[str, int] = {}

    def inject(self, name: str, pid: int, sig: int, group: bool = False) -> None:
        """Sends `sig` to `pid` (group: to its process group) and notes the time under `name`."""
        assert pid > 0, f"{name}: no process to signal (pid {pid})"  # kill(-1) hits every one
        self.at[name], self.pids[name] = time.monotonic(), pid
        (os.killpg if group else os.kill)(pid, sig)

    def recover(self, name: str) -> None:
        """Notes the first sign of recovery from fault `name` (an update logged after it)."""
        if name in self.at:
            self.recovered.setdefault(name, time.monotonic())

    def took(self, name: str) -> float:
        return self.recovered[name] - self.at[name]


def gone(pid: int, timeout: float = 10.0) -> bool:
    """True once process `pid` has exited (gone, or a zombie waiting to be reaped)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "zombie" in f.read():
                    return True
        except (FileNotFoundError, ProcessLookupError):  # exited between open and read
            return True
        time.sleep(0.05)
    return False


def release(pid: int, group: bool = False) -> None:
    """Ends a process (group: its process group) a test stopped, if it still exists (cleanup
    after SIGSTOP)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            (os.killpg if group else os.kill)(pid, sig)
        except ProcessLookupError:
            return


def final_meta(run_dir) -> dict:
    """The meta of the run's newest checkpoint (Orbax's JSON item)."""
    steps = [int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit()]
    path = os.path.join(run_dir, "checkpoints", str(max(steps)), "meta", "metadata")
    with open(path) as f:
        return json.load(f)


def check_run(
    run_dir, *, total: int, groups_per_update: int, group_size: int, eta: int, lossless=True
) -> dict:
    """The invariants of a completed run, from its metrics rows, episode dumps and final
    checkpoint: versions 0..total each logged once; every trained group trained exactly once
    and whole; every dispatched group trained, counted lost / dropped / filtered, buffered in
    the final checkpoint, or (at most the staleness window) still in flight. `lossless` (every
    fault but a learner's death, which takes its updates since the last checkpoint with it):
    nothing lost or dropped. Returns the last metrics row."""
    B, N = groups_per_update, group_size
    rows = metric_rows(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(total + 1)), f"versions logged: {steps}"  # contiguous, once each
    assert all(r["version"] == r["step"] for r in rows)
    assert len(glob.glob(os.path.join(run_dir, "episodes", "v*.jsonl"))) == total
    trained = trained_episodes(run_dir)  # raises on any episode trained twice
    groups = sorted({g for g, _ in trained})
    assert len(groups) == total * B, f"{len(groups)} groups trained, want {total * B}"
    assert sorted(trained) == [(g, i) for g in groups for i in range(N)]  # whole groups
    last = rows[-1]
    lost, dropped, filtered = (
        last.get(f"buffer/{k}", 0.0) for k in ("lost", "dropped", "filtered")
    )
    assert last["buffer/trained"] == total * B
    if lossless:  # the README's exactly once: no finished group left untrained but filtered
        assert lost == 0 and dropped == 0, f"{lost} groups lost, {dropped} dropped"
    assert last["buffer/finished"] == total * B + lost + dropped + filtered + last["buffer/size"]
    meta = final_meta(run_dir)
    assert meta["version"] == total and meta["step"] == total
    dispatched = meta["coordinator"]["dispatched"]
    buffered = load_groups(os.path.join(run_dir, "checkpoints", f"groups_{total}.npz"))
    assert not set(buffered) & set(groups), "a buffered group was trained already"
    assert set(groups) | set(buffered) <= set(range(dispatched))
    in_flight = dispatched - (total * B + lost + dropped + filtered + len(buffered))
    assert 0 <= in_flight <= (eta + 1) * B, (
        f"{dispatched} dispatched, {total * B} trained, {lost} lost, {dropped} dropped, "
        f"{filtered} filtered, {len(buffered)} buffered: {in_flight} unaccounted"
    )
    return last
