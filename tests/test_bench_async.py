"""The async benchmark at tiny size (a parseable RESULT line; no timing asserts), the longtail
task's budgets and reward, and the agent's per-problem overrides (budget, ignore_eos)."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl.agent import run_episodes
from rl.rollout.base import Generation, SamplingParams
from rl.tasks import get_task
from rl.tasks.base import Problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_async_prints_result_line(tmp_path):
    cmd = [sys.executable, "-m", "launch.bench", "async", "--updates", "2", "--prompts", "2"]
    cmd += ["--group", "2", "--min-tokens", "4", "--max-tokens", "8", "--eta", "1"]
    cmd += ["--num-eval", "2", "--pack", "32", "--run-root", str(tmp_path)]  # the packed path
    cmd += ["--partial", "drain,inflight"]  # the second policy's figures get suffixed keys
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout[-2000:]
    values = {k: float(v) for k, v in (kv.split("=") for kv in last.split()[1:])}
    for key in ("sync_s", "async_s", "speedup", "ideal", "frac_of_ideal", "G_s", "T_s", "Gc_s"):
        assert math.isfinite(values[key]) and values[key] > 0, (key, last)
    G, T, Gc = values["G_s"], values["T_s"], values["Gc_s"]
    assert values["ideal"] == pytest.approx((G + T) / max(Gc, T), rel=1e-3)
    assert values["speedup"] == pytest.approx(values["sync_s"] / values["async_s"], rel=1e-3)
    assert values["frac_of_ideal"] == pytest.approx(values["speedup"] / values["ideal"], rel=1e-3)
    assert values["window_compiles"] == 0  # engine buckets and packed learner shapes warmed
    for key in ("occupancy", "saturated_occupancy"):  # the async window's, the saturated pass's
        assert 0 < values[key] <= 1, (key, last)
    assert values["speedup_inflight"] == pytest.approx(
        values["sync_s"] / values["async_s_inflight"], rel=1e-3
    )


def test_longtail_budgets_are_seeded_clipped_and_heavy_tailed():
    opts = dict(min_tokens=16, max_tokens=128, alpha=1.2, seed=3)
    probs = get_task("longtail", **opts).problems("train", 4000)
    assert probs[:50] == get_task("longtail", **opts).problems("train", 50)  # seeded
    b = np.array([p.meta["max_new_tokens"] for p in probs])
    assert b.min() >= 16 and b.max() <= 128 and all(p.meta["ignore_eos"] for p in probs)
    # Pareto(1.2) scaled by 16: P(budget > x) = (16 / x) ** 1.2 below the clip at 128.
    for x in (32, 64):
        assert abs((b > x).mean() - (16 / x) ** 1.2) < 0.03
    assert abs((b == 128).mean() - (16 / 127.5) ** 1.2) < 0.03  # the clipped tail


def test_longtail_reward_is_fraction_of_even_digits():
    task = get_task("longtail")
    p = task.problems("train", 1)[0]
    assert task.reward(p, "2a4b7").reward == pytest.approx(2 / 3)
    assert task.reward(p, "13579").reward == 0.0
    assert task.reward(p, "xyz").reward == 0.0 and not task.reward(p, "xyz").formatted
    assert task.reward(p, task.demonstration(p)).reward == 1.0
    assert len(task.demonstration(p)) == p.meta["max_new_tokens"]


class _Recorder:
    """An engine that answers every request with `max_new_tokens` eos tokens, recording it."""

    version = 0

    def __init__(self, eos):
        self.eos, self.requests = eos, []

    def generate(self, requests):
        self.requests += requests
        out = []
        for r in requests:
            n = r.params.max_new_tokens
            ids = np.full(n, self.eos, np.int32)
            stop = self.eos in r.params.stop_token_ids
            ids = ids[:1] if stop else ids
            out.append(
                Generation(
                    r.request_id,
                    ids,
                    np.zeros(len(ids), np.float32),
                    np.zeros(len(ids), np.int32),
                    "stop" if stop else "length",
                )
            )
        return out


def test_agent_per_problem_budget_and_ignore_eos(tmp_path):
    tok = load_tokenizer(build_task_tokenizer(str(tmp_path)))
    task = get_task("arithmetic")
    base = task.problems("train", 1)[0]
    problems = [
        base,  # no overrides: the params' budget, stops on eos
        Problem("a", base.prompt, base.answer, {"max_new_tokens": 5, "ignore_eos": True}),
        Problem("b", base.prompt, base.answer, {"max_new_tokens": 50, "ignore_eos": True}),
    ]
    eng = _Recorder(tok.eos_id)
    eps = run_episodes(eng, task, tok, problems, SamplingParams(max_new_tokens=9), seeds=[1, 2, 3])
    budgets = [r.params.max_new_tokens for r in eng.requests]
    assert budgets == [9, 5, 9]  # the per-problem budget, capped by the rollout's
    assert tok.eos_id in eng.requests[0].params.stop_token_ids
    assert eng.requests[1].params.stop_token_ids == eng.requests[2].params.stop_token_ids == ()
    assert [e.num_generated for e in eps] == [1, 5, 9]


def test_timeline_summary_counts_empty_slots_and_stalls():
    """Empty slot-seconds split by whether rows were queued; stalls are slow scheduler calls
    other than read-backs; events outside the window are left out."""
    from launch.benches.async_bench import timeline_summary

    events = [  # (kind, start, end, live, queued, cache length, slots) for chunks
        ("chunk", 0.5, 0.51, 8, 0, 64, 8),  # before the window
        ("chunk", 1.0, 1.01, 6, 0, 64, 8),  # 1.0 -> 1.1: 2/8 empty, nothing queued
        ("read", 1.02, 1.5),  # a read-back waits for the device: no stall
        ("chunk", 1.1, 1.11, 4, 3, 64, 8),  # 1.1 -> 1.3: 4/8 empty, rows queued
        ("admit", 1.2, 1.35, 2),  # a stall
        ("chunk", 1.3, 1.31, 8, 0, 64, 8),
        ("install", 1.32, 1.34),  # short
        ("chunk", 2.5, 2.51, 0, 0, 64, 8),  # after the window
    ]
    s = timeline_summary(events, 1.0, 2.0)
    assert s["chunks"] == 3
    assert s["chunk_ms"] == pytest.approx(150.0)  # median of 100 and 200 ms
    assert s["empty_starved_s"] == pytest.approx(0.1 * 2 / 8)
    assert s["empty_queued_s"] == pytest.approx(0.2 * 4 / 8)
    assert s["stalls"] == [("admit", 0.2, 0.15)]
