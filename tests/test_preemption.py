"""Preemption: SIGTERM stops a run at its next safe point with a checkpoint of the current version
and every finished group, and exits 0 within trainer.preempt_deadline_s; --resume continues it,
every group trained exactly once. A learner wait ended on purpose takes nothing from the buffer."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from run_files import metric_rows, trained_episodes

from rl.buffer import GroupBuffer, Stopped
from rl.coordinator import Coordinator
from rl.types import Episode, EpisodeGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _group(gid: int, rewards) -> EpisodeGroup:
    eps = tuple(
        Episode("p", np.arange(4), np.array([0, 0, 1, 1]), np.zeros(4), np.zeros(4), 2, float(r))
        for r in rewards
    )
    return EpisodeGroup(gid, "p", eps, 0)


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_a_stopped_wait_puts_back_what_it_took(policy):
    coord = Coordinator(3, 0)
    buf = GroupBuffer(coord, stale_policy=policy)
    assert coord.admit(6, timeout=1) == [(i, 0) for i in range(3)]
    buf.put(_group(0, [1, 0]))
    buf.put(_group(1, [1, 1]))  # all-equal rewards: filtered, consumed
    buf.put(_group(2, [0, 1]))
    before = buf.state()
    # The batch needs 3 usable groups; 2 are there: the wait ends by stop() after taking them.
    t = time.perf_counter()
    threading.Timer(0.2, buf.stop, args=("SIGTERM",)).start()
    with pytest.raises(Stopped, match="SIGTERM"):
        buf.get_batch(3, 0, timeout=30)
    assert time.perf_counter() - t < 5
    state, groups = buf.state()
    assert sorted(groups) == [0, 2]  # the usable groups are back; group 1 stays consumed
    assert state["counts"]["filtered"] == 1 and state["counts"]["trained"] == 0
    assert before[0]["next_group"] == 0
    buf.stopped = None  # a resumed buffer: the same two groups come first
    buf.put(_group(3, [0, 1]))
    assert [g.group_id for g in buf.get_batch(3, 0, timeout=5)] == [0, 2, 3]


BASE = [
    "sft.steps=0",
    "task.num_eval=4",
    "rollout.prompts_per_update=2",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=8",
    "algorithm.filter_zero_advantage=false",
    "trainer.mode=async",
    "trainer.max_staleness=1",
    "trainer.eval_every=0",
    "trainer.preempt_deadline_s=60",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.save_episodes=8",  # every trained episode is dumped with its group id
]


def _train(root, *extra):
    cmd = [sys.executable, "-m", "launch.train", "--set", f"run_root={root}", "--set", "name=p"]
    for kv in (*BASE, *extra):
        cmd += ["--set", kv]
    return cmd


def test_sigterm_checkpoints_exits_zero_and_resume_trains_each_group_once(tmp_path):
    total, run_dir = 12, tmp_path / "p"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        _train(tmp_path, f"trainer.total_updates={total}"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 240:  # until update 3 is logged
        if (run_dir / "metrics.jsonl").exists() and len(metric_rows(run_dir)) >= 4:
            break
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    t_sig = time.perf_counter()
    out, err = proc.communicate(timeout=90)
    took = time.perf_counter() - t_sig
    assert proc.returncode == 0, err[-3000:]
    assert took < 60, f"exited {took:.1f} s after SIGTERM"
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted (SIGTERM) at version "), err[-2000:]
    stopped_at = int(last.split("at version ")[1].split(":")[0])
    assert 3 <= stopped_at < total
    assert str(stopped_at) in os.listdir(run_dir / "checkpoints")

    again = subprocess.run(
        [*_train(tmp_path, f"trainer.total_updates={total}"), "--resume"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(total + 1))  # each version once
    trained = trained_episodes(run_dir)  # raises on any episode trained twice
    assert sorted(trained) == [(g, i) for g in range(total * 2) for i in range(4)]
