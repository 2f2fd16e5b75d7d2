"""End-to-end trainer runs (tiny model, CPU): run directory, sync == async(eta 0), exact resume,
and the staleness bound of async mode."""

import json
import os

import jax
import numpy as np
import pytest
import yaml
from jax.experimental.compilation_cache import compilation_cache

from rl import config as C
from rl.trainer import train

pytestmark = pytest.mark.slow  # whole training runs (module fixtures)

TOTAL = 3
BASE = [
    "sft.steps=20",  # enough for well-formed answers: rewards 0 / 0.1 vary within a group
    "sft.batch_size=16",
    "sft.lr=5e-3",
    "rollout.prompts_per_update=4",
    "rollout.group_size=4",
    "rollout.batch_size=16",  # four groups per engine batch: every run reuses the same programs
    "task.num_eval=16",
    "logging.progress=false",
    "trainer.eval_every=0",
    "seed=3",
]
LOSS_KEYS = ("loss/loss", "loss/pg_loss")


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Runs share compiled programs through a persistent cache (the runs compile the same
    programs; this only saves time). Restored afterwards."""
    old = jax.config.jax_compilation_cache_dir
    old_time = jax.config.jax_persistent_cache_min_compile_time_secs
    old_size = jax.config.jax_persistent_cache_min_entry_size_bytes
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jit_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", old)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old_time)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", old_size)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


def _cfg(root, name, *overrides):
    return C.load(None, [*BASE, f"run_root={root}", f"name={name}", *overrides])


def _rows(root, name):
    with open(os.path.join(root, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _by_step(rows):
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def sync_run(root):
    train(_cfg(root, "sync", f"trainer.total_updates={TOTAL}"))
    return _rows(root, "sync")


@pytest.fixture(scope="module")
def async0_run(root):
    train(
        _cfg(
            root,
            "async0",
            f"trainer.total_updates={TOTAL}",
            "trainer.mode=async",
            "trainer.max_staleness=0",
            "trainer.sync_every=1",
            "rollout.batch_invariant=true",  # log-probs independent of the dispatch batches
        )
    )
    return _rows(root, "async0")


@pytest.fixture(scope="module")
def resumed_run(root):
    train(_cfg(root, "resumed", f"trainer.total_updates={TOTAL - 1}"))
    first = _rows(root, "resumed")
    train(_cfg(root, "resumed", f"trainer.total_updates={TOTAL}"), resume=True)
    return first, _rows(root, "resumed")


def _assert_losses_equal(a_rows, b_rows, steps):
    a, b = _by_step(a_rows), _by_step(b_rows)
    for s in steps:
        for k in LOSS_KEYS:
            assert abs(a[s][k] - b[s][k]) <= 1e-6, (s, k, a[s][k], b[s][k])
        assert a[s]["reward/mean"] == b[s]["reward/mean"]


def test_packed_run_matches_unpacked(root, sync_run):
    """learner.pack: the first update (same rollouts) has the unpacked loss, in fewer rows."""
    train(
        _cfg(
            root, "packed", "trainer.total_updates=1", "learner.pack=true", "learner.pack_length=64"
        )
    )
    packed, plain = _by_step(_rows(root, "packed"))[1], _by_step(sync_run)[1]
    assert packed["reward/mean"] == plain["reward/mean"]
    for k in LOSS_KEYS + ("loss/entropy", "loss/logp_mean"):
        assert abs(packed[k] - plain[k]) <= 1e-5, (k, packed[k], plain[k])
    assert plain["batch/rows"] == 16 and packed["batch/rows"] < plain["batch/rows"]
    assert packed["batch/padding"] < plain["batch/padding"]


# ---------------------------------------------------------------------------------------------
# (a) the run directory


def test_run_directory(root, sync_run):
    rows = sync_run
    assert [r["step"] for r in rows] == list(range(TOTAL + 1))  # step 0: evaluation before RL
    for r in rows:
        assert {"step", "version", "time"} <= set(r) and r["version"] == r["step"]
    times = [r["time"] for r in rows]
    assert times == sorted(times) and times[0] >= 0
    for r in rows[1:]:
        for k in ("reward/mean", "loss/loss", "loss/pg_loss", "staleness/max", "loss/grad_norm"):
            assert k in r and np.isfinite(r[k]), k
        assert r["staleness/max"] == 0  # sync: on-policy
    for r in (rows[0], rows[-1]):  # evaluated at the start and at the end
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and "eval/reward" in r
    assert "eval/accuracy" not in rows[1]
    # Start-up: its phases at step 0; at the first update the time since the process began and
    # the programs compiled (or loaded from the cache) here and in the rollout process.
    phases = ("built_s", "warm_start_s", "rollout_s", "eval_s")
    assert all(rows[0][f"startup/{p}"] > 0 for p in phases)
    first = rows[1]["startup/first_update_s"]
    assert first > sum(rows[0][f"startup/{p}"] for p in phases)
    assert rows[1]["compile/programs"] >= rows[0]["compile/programs"] > 0
    assert rows[1]["rollout_compile/programs"] > 0  # placement auto on a CPU: a process
    assert all("startup/first_update_s" not in r for r in rows[2:])
    with open(os.path.join(root, "sync", "compile.json")) as f:  # the same, program by program
        report = json.load(f)
    assert report["first_update_s"] == first
    assert all(report["phases"][f"startup/{p}"] == rows[0][f"startup/{p}"] for p in phases)
    for side, key in (("this_process", "compile/"), ("rollout_process", "rollout_compile/")):
        programs = report[side]["programs"]
        assert sum(n for n, _ in programs.values()) == rows[1][key + "programs"]
        assert sum(s for _, s in programs.values()) == pytest.approx(
            rows[1][key + "compile_s"], abs=0.01
        )
        seconds = [s for _, s in programs.values()]
        assert seconds == sorted(seconds, reverse=True)
    # the run learns something to compare: non-trivial losses and rewards
    assert any(abs(r["loss/pg_loss"]) > 1e-4 for r in rows[1:])
    assert any(r["reward/mean"] > 0 for r in rows[1:])

    run = os.path.join(root, "sync")
    with open(os.path.join(run, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert C.from_dict(saved) == _cfg(root, "sync", f"trainer.total_updates={TOTAL}")
    ckpts = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert str(TOTAL) in ckpts
    episodes = sorted(os.listdir(os.path.join(run, "episodes")))
    assert episodes == [f"v{v:06d}.jsonl" for v in range(1, TOTAL + 1)]
    with open(os.path.join(run, "episodes", episodes[0])) as f:
        first = [json.loads(line) for line in f]
    assert len(first) == 4 and {"prompt", "completion", "reward", "versions"} <= set(first[0])


# ---------------------------------------------------------------------------------------------
# (b) async with eta = 0 and sync_every = 1 is synchronous RL: against a plain sync loop


def _plain_sync_losses(cfg, updates: int) -> list[dict]:
    """Synchronous GRPO written out: generate groups in dispatch order with the current weights,
    skip all-equal-reward groups (at most 4 x B per update, as the buffer), take B, compute
    advantages, update. Shares only the building blocks (model, warm start, engine, learner)."""
    from models.tokenizer import build_task_tokenizer, load_tokenizer
    from rl import build
    from rl.agent import run_episodes
    from rl.algorithms.advantages import compute_advantages
    from rl.learner import make_batch
    from rl.learner_setup import make_learner
    from rl.rollout.jax_engine import JaxEngine
    from rl.sft import warm_start_run
    from rl.tasks import get_task

    tok = load_tokenizer(build_task_tokenizer(os.path.join(cfg.run_root, "plain-tok")))
    task = get_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.options)
    B, n = cfg.rollout.prompts_per_update, cfg.rollout.group_size
    _, learner, ckpt = make_learner(
        cfg, tok.vocab_size, jax.devices(), os.path.join(cfg.run_root, "plain")
    )
    ckpt.close()
    warm_start_run(cfg, learner, task, tok)
    row_len = build.row_length(cfg, task, tok, task.problems("eval", cfg.task.num_eval))
    engine = JaxEngine(
        learner.model, max_batch=cfg.rollout.batch_size, cache_len=row_len, version=0
    )
    problems = task.problems("train", 500)
    params = build.sampling(cfg)
    g, out = 0, []
    try:
        for version in range(updates):
            engine.update_weights(version, learner.weights())
            rewards, episodes, skipped = [], [], 0
            while len(rewards) < B:
                seeds = [build.episode_seed(cfg.seed, g, i) for i in range(n)]
                eps = run_episodes(engine, task, tok, [problems[g]] * n, params, seeds=seeds)
                g += 1
                r = np.array([e.reward for e in eps], np.float32)
                if len(set(r.tolist())) == 1 and skipped < 4 * B:
                    skipped += 1
                    continue
                rewards.append(r)
                episodes += eps
            adv = np.asarray(compute_advantages(cfg.algorithm.advantage, np.stack(rewards)))
            batch = make_batch(episodes, adv.reshape(-1), num_rows=B * n, row_len=row_len)
            met = learner.update(batch)
            out.append({f"loss/{k}": v for k, v in met.items() if not k.startswith("timing")})
            out[-1]["reward/mean"] = float(np.mean([e.reward for e in episodes]))
    finally:
        engine.close()
    return out


def test_async_eta0_equals_plain_sync_loop(root, async0_run):
    cfg = _cfg(root, "plain-sync", "rollout.batch_invariant=true")
    plain = _plain_sync_losses(cfg, TOTAL)
    rows = _by_step(async0_run)
    assert all(r["staleness/max"] == 0 for r in async0_run[1:])
    for step, expected in enumerate(plain, start=1):
        for k in LOSS_KEYS + ("loss/entropy", "reward/mean"):
            assert rows[step][k] == expected[k], (step, k, rows[step][k], expected[k])
    assert any(abs(r["loss/pg_loss"]) > 1e-4 for r in plain)  # nothing trivially equal


def test_batch_invariant_sampler_compiles_before_the_run_serves(async0_run):
    """The trainer warms its JAX sampler (build.warm_spec) on fixed slots (batch-invariant
    here, an accelerator's by default): every program the run's rollouts and evaluations use is
    compiled before the first update, none while it serves."""
    rows = [r for r in async0_run if "rollout/compilations" in r]  # the update rows
    assert len(rows) == TOTAL
    # all of them warm()'s but the serving layout's (traced when the engine is built)
    for r in rows:
        assert r["rollout/compilations_warm"] > 1
        assert r["rollout/compilations"] == r["rollout/compilations_warm"] + 1, r


# ---------------------------------------------------------------------------------------------
# (c) exact resume


def test_resume_reproduces_uninterrupted_run(sync_run, resumed_run):
    first, resumed = resumed_run
    assert [r["step"] for r in first] == list(range(TOTAL))
    assert [r["step"] for r in resumed] == list(range(TOTAL + 1))  # each step exactly once
    _assert_losses_equal(sync_run, resumed, range(1, TOTAL + 1))
    times = [r["time"] for r in resumed]
    assert times == sorted(times)


# ---------------------------------------------------------------------------------------------
# (d) the staleness bound in async mode


@pytest.mark.parametrize("partial", ["drain", "inflight"])
def test_async_staleness_bounded(root, partial):
    """The bound holds whether live rows finish on their weights or go on under new ones."""
    name = f"async2-{partial}"
    train(
        _cfg(
            root,
            name,
            f"trainer.total_updates={TOTAL}",
            "trainer.mode=async",
            "trainer.max_staleness=2",
            "rollout.streams=12",  # the bound's worth of groups in flight: generation runs ahead
            f"trainer.partial={partial}",
        )
    )
    rows = _rows(root, name)[1:]
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert all(r["staleness/bound"] == 2 for r in rows)
    assert max(r["staleness/max"] for r in rows) >= 1  # generation really ran ahead
