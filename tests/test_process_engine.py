"""ProcessEngine: a JaxEngine in a pinned child process gives the in-process engine's tokens and
log-probs, serves new weights after update_weights, returns 'abort' partials when an update
interrupts it (update mode continue), and fails fast and clearly when its process dies."""

import json
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache
from model_weights import randomize
from run_files import compared_keys

from models import create_model, tiny
from rl.placement import core_split
from rl.rollout.base import GenerationRequest, SamplingParams, WorkerLost
from rl.rollout.jax_engine import JaxEngine
from rl.rollout.process_engine import ProcessEngine, RolloutProcessError

CONFIG = tiny()


def _reqs(n, max_new, temperature=1.0, prefix="r"):
    rng = np.random.RandomState(7)
    return [
        GenerationRequest(
            f"{prefix}{i}",
            rng.randint(3, CONFIG.vocab_size, size=3 + i % 4).astype(np.int32),
            SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=100 + i),
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def models():
    old = randomize(create_model(CONFIG, seed=0), seed=0)
    new = randomize(create_model(CONFIG, seed=0), seed=1)
    return old, new


@pytest.fixture(scope="module")
def engine(models):
    eng = ProcessEngine(models[0], cores=(0,), chunk=4, deadline_s=120, update_mode="continue")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ref(models):
    """The in-process reference engine (same chunk; shares compiled programs across tests)."""
    return JaxEngine(models[0], chunk=4)


# One batch shape (8 rows, 16-token bucket) for the comparisons: few compilations.
REQS = _reqs(6, 12) + _reqs(2, 12, temperature=0.0, prefix="g")


def _both(engine, ref, reqs):
    """(child's generations, in-process generations); the two compile in parallel."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("child", engine.generate(reqs)))
    t.start()
    want = ref.generate(reqs)
    t.join(120)
    return out["child"], want


def _assert_same(got, want):
    assert [g.request_id for g in got] == [w.request_id for w in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
        np.testing.assert_array_equal(g.versions, w.versions)
        assert g.finish_reason == w.finish_reason
        assert np.abs(g.logprobs - w.logprobs).max() <= 1e-6


@pytest.mark.slow
def test_child_is_pinned(engine):
    assert os.sched_getaffinity(engine.pid) == {0}
    assert engine.child_cores == (0,)


@pytest.mark.slow
def test_generations_equal_in_process_engine(engine, ref):
    got, want = _both(engine, ref, REQS)
    _assert_same(got, want)
    assert all(len(g.token_ids) == 12 and g.finish_reason == "length" for g in want)


def test_update_weights_changes_version_and_logprobs(models, engine, ref):
    old, new = models
    before = engine.generate(REQS)
    engine.update_weights(5, nnx.state(new, nnx.Param)).wait(60)
    ref.update_weights(5, nnx.state(new, nnx.Param)).wait()
    assert engine.version == 5
    after, want = _both(engine, ref, REQS)
    _assert_same(after, want)
    assert all((g.versions == 5).all() for g in after)
    greedy = [i for i, r in enumerate(REQS) if r.params.temperature == 0]
    diff = max(np.abs(after[i].logprobs - before[i].logprobs).max() for i in greedy)
    assert diff > 1e-2  # the served weights really changed
    t = engine.sync_times[-1]
    assert t["total_s"] >= t["install_s"] > 0
    engine.update_weights(0, nnx.state(old, nnx.Param)).wait(60)  # back for the other tests
    ref.update_weights(0, nnx.state(old, nnx.Param)).wait()
    _assert_same(engine.generate(REQS), before)


def test_update_without_waiting_is_served_to_later_generates(models, engine, ref):
    """update_weights returns at once; a generate sent after it sees the new weights (the child
    serves in message order) and the handle's on_served(version) comes once they are installed."""
    old, new = models
    served = []
    engine.update_weights(7, nnx.state(new, nnx.Param)).then(served.append)
    ref.update_weights(7, nnx.state(new, nnx.Param)).wait()
    got, want = _both(engine, ref, REQS)
    _assert_same(got, want)
    assert served == [7] and engine.version == 7
    engine.update_weights(0, nnx.state(old, nnx.Param)).wait(60)
    ref.update_weights(0, nnx.state(old, nnx.Param)).wait()


def test_interrupting_update_returns_abort_partials(models, engine):
    """An update (mode continue) lands while the child generates: 'abort' partials."""
    reqs = _reqs(8, 2000, prefix="long")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("gens", engine.generate(reqs)))
    t.start()
    deadline = time.monotonic() + 60
    while not engine.stats()["generating"]:
        assert time.monotonic() < deadline, "the generate never started"
        time.sleep(0.005)
    update = engine.update_weights(1, nnx.state(models[1], nnx.Param))
    t.join(60)
    update.wait(60)
    gens = result["gens"]
    assert all(g.finish_reason == "abort" for g in gens)
    n = {len(g.token_ids) for g in gens}
    assert len(n) == 1 and 1 <= n.pop() < 2000  # one batch, cut at a chunk boundary
    assert all((g.versions == 0).all() for g in gens)  # every token came from the old weights
    short = [GenerationRequest("after", reqs[0].prompt_ids, SamplingParams(4, seed=1))]
    assert (engine.generate(short)[0].versions == 1).all()
    engine.update_weights(0, nnx.state(models[0], nnx.Param)).wait(60)


def test_killed_child_raises_clear_error_within_deadline(models):
    eng = ProcessEngine(models[0], cores=(0,), chunk=4, deadline_s=60, name="victim")
    try:
        reqs = _reqs(8, 2000, prefix="k")
        err = {}

        def gen():
            try:
                eng.generate(reqs)
            except RolloutProcessError as e:
                err["e"] = e

        t = threading.Thread(target=gen)
        t.start()
        time.sleep(0.5)
        errors, served = [], []  # a drain update waits behind the generate, then the kill
        new = nnx.state(models[1], nnx.Param)
        eng.update_weights(1, new).then(served.append, errors.append)
        t0 = time.monotonic()
        os.kill(eng.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and time.monotonic() - t0 < 15
        msg = str(err["e"])
        assert "victim" in msg and str(eng.pid) in msg and "exit code -9" in msg, msg
        assert not served and len(errors) == 1 and "exit code -9" in str(errors[0])
        with pytest.raises(RolloutProcessError, match="exit code -9"):
            eng.generate(reqs[:1])  # later calls fail at once
        eng.abort()  # shutdown paths stay quiet on a dead child
    finally:
        eng.close()


@pytest.mark.slow
def test_killed_child_is_replaced_on_the_newest_weights_then_the_limit_stops_it(models):
    """SIGKILL mid-generate with max_restarts=1: the generate raises WorkerLost (its work can be
    dispatched again), the update the child took with it is served by a replacement on the new
    weights, and later calls run there; a second SIGKILL is past the limit: a clear error."""
    eng = ProcessEngine(
        models[0], cores=(0,), chunk=4, deadline_s=60, name="phoenix", max_restarts=1
    )
    try:
        first = eng.pid
        reqs = _reqs(8, 2000, prefix="k")
        err = {}

        def gen():
            try:
                eng.generate(reqs)
            except WorkerLost as e:
                err["e"] = e

        t = threading.Thread(target=gen)
        t.start()
        time.sleep(0.5)
        errors, served = [], []  # a drain update waits behind the generate, then the kill
        eng.update_weights(1, nnx.state(models[1], nnx.Param)).then(served.append, errors.append)
        os.kill(first, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        msg = str(err["e"])
        assert "phoenix" in msg and str(first) in msg and "exit code -9" in msg, msg
        out = eng.generate(_reqs(2, 4, prefix="after"))  # waits for the replacement
        assert eng.pid != first and eng.process.name == "phoenix.r1"
        assert served == [1] and errors == [] and eng.version == 1
        assert all((g.versions == 1).all() for g in out)
        stats = eng.stats()
        assert stats["restarts"] == 1 and stats["workers_lost"] == 1 and stats["pid"] == eng.pid
        os.kill(eng.pid, signal.SIGKILL)
        with pytest.raises(RolloutProcessError, match=r"1 of trainer.max_rollout_restarts=1"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the reader has seen the death
                eng.generate(_reqs(1, 2, prefix="late"))
                time.sleep(0.2)
    finally:
        eng.close()


def test_child_dying_at_startup_raises_clear_error(models):
    """A child that cannot start (XLA aborts on an unknown flag) is an error naming it and its
    exit code, within seconds, never a hang."""
    t0 = time.monotonic()
    with pytest.raises(RolloutProcessError, match=r"'doomed'.*died \(exit code"):
        ProcessEngine(models[0], xla_flags="--no_such_xla_flag=1", deadline_s=60, name="doomed")
    assert time.monotonic() - t0 < 30


def test_core_split_validates():
    assert core_split([0], [], available=(0, 1)).learner == (1,)
    assert core_split([1], [0], available=(0, 1, 2)).learner == (0,)
    with pytest.raises(ValueError, match="leave no core"):
        core_split([0, 1], [], available=(0, 1))
    with pytest.raises(ValueError, match="not available"):
        core_split([5], [], available=(0, 1))
    with pytest.raises(ValueError, match="share cores"):
        core_split([0], [0], available=(0, 1))


# -- the trainer with pin_cores: the same numbers as in process, in every mode ----------------

RUN = [
    "task.name=longtail",
    "task.options={min_tokens: 4, max_tokens: 12}",
    "task.num_eval=4",
    "sft.steps=0",
    "rollout.prompts_per_update=2",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=12",
    "algorithm.filter_zero_advantage=false",
    "trainer.total_updates=3",
    "trainer.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "seed=5",
]


@pytest.mark.slow
def test_trainer_pin_cores_reproduces_in_process_run(tmp_path):
    """Sync with the rollout in a pinned process, and in an unpinned one (placement process),
    equals the in-process run (losses, rewards, eval). The test process is unpinned afterwards.
    (Async with pin_cores: test_bench_async.)"""
    from rl import config as C
    from rl.placement import pin_threads
    from rl.rollout import process_engine as PE
    from rl.trainer import Trainer

    children: list[tuple[int, tuple]] = []  # (pid, cores) of each run's rollout process

    def record(engine):
        if isinstance(engine, PE.ProcessEngine):
            children.append((engine.process.pid, engine.cores))

    def run(name, *extra):
        cfg = C.load(None, [*RUN, f"run_root={tmp_path}", f"name={name}", *extra])
        Trainer(cfg).run(on_engine=record)
        with open(tmp_path / name / "metrics.jsonl") as f:
            return {r["step"]: r for r in map(json.loads, f)}

    cores = os.sched_getaffinity(0)
    # The pinned run's rollout process loads the in-process run's programs from a disk cache.
    cache = {
        "jax_compilation_cache_dir": str(tmp_path / "jit_cache"),
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    old = {k: getattr(jax.config, k) for k in cache}
    env = {k.upper(): os.environ.get(k.upper()) for k in cache}
    for k, v in cache.items():
        jax.config.update(k, v)
        os.environ[k.upper()] = str(v)
    compilation_cache.reset_cache()
    try:
        plain = run("plain", "trainer.placement=in_process")
        shared = run("shared", "trainer.placement=process")
        assert os.sched_getaffinity(0) == cores  # nothing pinned
        pinned = run("pinned", "trainer.pin_cores=true")
        assert os.sched_getaffinity(0) == cores - {0}  # the learner left core 0 to the rollout
    finally:
        pin_threads(cores)
        for k, v in old.items():
            jax.config.update(k, v)
        for k, v in env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        compilation_cache.reset_cache()
    assert [c for _, c in children] == [(), (0,)]  # shared: every core; pinned: core 0
    assert all(pid != os.getpid() for pid, _ in children)
    assert sorted(plain) == sorted(pinned) == sorted(shared) == [0, 1, 2, 3]
    for step in plain:
        keys = compared_keys(plain[step], step)
        for key in keys:
            for other in (pinned, shared):
                assert other[step][key] == pytest.approx(plain[step][key], abs=1e-6), (step, key)
    assert plain[3]["episode/length"] > 4  # ignore_eos budgets: longer than the minimum


def test_pin_cores_needs_the_jax_engine():
    from rl import config as C

    with pytest.raises(C.ConfigError, match="trainer.pin_cores.*rollout.engine 'jax'"):
        C.load(None, ["trainer.pin_cores=true", "rollout.engine=vllm"])


# -- the trainer replaces a killed rollout process ------------------------------------------


def kill_at_rollout_call(n: int, killed: list):
    """on_engine hook: at the engine's n-th generate from the rollout thread, the real child is
    stopped (SIGSTOP) as the call is sent and SIGKILLed half a second later, so the kill lands
    while that generate is in flight. Records the killed pids."""

    def hook(engine):
        real, calls = engine.generate, []

        def generate(requests):
            if threading.current_thread().name.startswith("rollout-"):
                calls.append(len(requests))
                if len(calls) == n:
                    pid = engine.pid
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL)).start()
                    killed.append(pid)
            return real(requests)

        engine.generate = generate

    return hook


RESTART_RUN = [
    *RUN,
    "trainer.mode=async",
    "trainer.max_staleness=1",
    "logging.save_episodes=8",  # every trained episode is dumped with its group id
]


@pytest.mark.slow
def test_sigkilled_rollout_process_past_the_limit_fails_the_run_clearly(tmp_path):
    from rl import config as C
    from rl.trainer import Trainer

    killed = []
    cfg = C.load(
        None,
        [*RESTART_RUN, f"run_root={tmp_path}", "name=k0", "trainer.max_rollout_restarts=0"],
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rollout failed") as err:  # the learner hears of it
        Trainer(cfg).run(on_engine=kill_at_rollout_call(1, killed))
    assert time.monotonic() - t0 < 120
    assert isinstance(err.value.__cause__, RolloutProcessError)
    msg = str(err.value.__cause__)
    assert f"pid {killed[0]}" in msg and "died (exit code -9)" in msg, msg
    assert "0 of trainer.max_rollout_restarts=0 replacements used, the run stops" in msg, msg


def test_max_rollout_restarts_validates():
    from rl import config as C

    with pytest.raises(C.ConfigError, match=r"trainer.max_rollout_restarts: invalid value -1"):
        C.load(None, ["trainer.max_rollout_restarts=-1"])
