"""The `ray` transport: rollout workers, the learner and the parameter server as actors in
their own processes, episode batches in the object store, a real SIGKILL of a worker mid-run
(re-dispatch, every finished episode trained exactly once), a worker that stops answering
(SIGSTOP), the restart limit, lossless resume (checkpoints written by the learner actor)."""

import os
import signal
import time

import numpy as np
import pytest
import ray
from chaos import gone as _gone
from run_files import metric_rows, trained_episodes

from rl import build
from rl import config as C
from rl.checkpoint import load_groups
from rl.ray.learner import LearnerError
from rl.ray.pool import RayOptions, RolloutWorkerError, WorkerPool
from rl.rollout.base import Weights, WorkerLost
from rl.trainer import Trainer
from rl.types import Episode, EpisodeGroup, groups_from_arrays, groups_to_arrays

B, N = 2, 4  # groups per update, samples per group
BASE = [
    "sft.steps=0",
    f"rollout.prompts_per_update={B}",
    f"rollout.group_size={N}",
    f"rollout.batch_size={B * N}",  # one worker call runs B groups
    "rollout.max_new_tokens=8",
    "task.num_eval=4",
    "algorithm.filter_zero_advantage=false",  # every finished group is trained: countable
    "trainer.mode=async",
    "trainer.max_staleness=1",
    "trainer.eval_every=0",
    "trainer.transport=ray",
    "trainer.deadline_s=120",
    "logging.progress=false",
    "logging.tensorboard=false",
    f"logging.save_episodes={B * N}",  # every trained episode is dumped with its group id
]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module; the actors inherit this process's XLA_FLAGS."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # learner + 2 workers
    yield
    ray.shutdown()


def _cfg(root, name, *overrides):
    return C.load(None, [*BASE, f"run_root={root}", f"name={name}", *overrides])


def _watch(seen: dict, at_step: int, action) -> dict:
    """Trainer.run hooks: keep the worker pool in seen['pool']; run action() at update at_step."""

    def keep(engine):
        seen["pool"] = engine

    def act(version, row):
        if version == at_step:
            action()

    return {"on_engine": keep, "on_update": act}


def _episode(seed, n_prompt, n_gen):
    rng = np.random.default_rng(seed)
    L = n_prompt + n_gen
    return Episode(
        f"p{seed}",
        rng.integers(0, 100, L),
        np.r_[np.zeros(n_prompt), np.ones(n_gen)].astype(np.int8),
        rng.normal(size=L).astype(np.float32),
        np.r_[np.full(n_prompt, -1), np.full(n_gen, seed)].astype(np.int32),
        n_prompt,
        reward=0.1 * seed,
        correct=bool(seed % 2),
        finish_reason="length",
        num_turns=2,
        completion_text=f"text {seed}",
    )


def test_pack_unpack_round_trip():
    groups = [
        EpisodeGroup(7, "p", (_episode(1, 3, 5), _episode(2, 4, 0)), 3),
        EpisodeGroup(9, "q", (_episode(3, 2, 6),), 4),
    ]
    batch = groups_to_arrays(groups)
    n_tokens = (3 + 5) + (4 + 0) + (2 + 6)
    per_token = [k for k, v in batch.items() if v.size == n_tokens]
    assert sorted(per_token) == ["behavior_logp", "loss_mask", "tokens", "versions"]
    assert all(v.dtype != object for v in batch.values())  # numpy only, no pickled objects
    back = groups_from_arrays(batch)
    assert [(g.group_id, g.problem_id, g.dispatch_version) for g in back] == [
        (7, "p", 3),
        (9, "q", 4),
    ]
    for g0, g1 in zip(groups, back):
        assert len(g0.episodes) == len(g1.episodes)
        for a, b in zip(g0.episodes, g1.episodes):
            for name in ("tokens", "loss_mask", "behavior_logp", "versions"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
                assert getattr(a, name).dtype == getattr(b, name).dtype
            for name in ("problem_id", "prompt_len", "reward", "correct", "finish_reason"):
                assert getattr(a, name) == getattr(b, name)
            assert (a.num_turns, a.completion_text) == (b.num_turns, b.completion_text)


@pytest.mark.slow
def test_worker_processes_object_store_hang_and_restart_limit(cluster, tmp_path):
    """Direct use of the pool: separate pids, batches as shared-memory numpy, a SIGSTOPped
    worker detected within the health deadline, a hung idle worker skipped (and killed) by a
    weight update, then the restart limit's error."""
    trainer = Trainer(_cfg(str(tmp_path), "pool", "trainer.transport=local"))  # a model here
    opts = RayOptions(num_workers=1, health_deadline_s=2.0, max_restarts=1, log_dir=str(tmp_path))
    pool = WorkerPool(
        Weights(params=trainer.learner.params()),
        trainer.learner.model.config,
        version=0,
        task={"section": {"name": "arithmetic"}, "preset": True, "imports": []},
        tokenizer_dir=trainer.tok_dir,
        options=opts,
        engine_kwargs={"max_batch": B * N},
        call_deadline_s=60,
    )
    try:
        pid0 = pool.pids()[0]
        assert pid0 not in (os.getpid(), -1) and os.path.exists(f"/proc/{pid0}")
        items = trainer.group_work([(0, 0), (1, 0)])
        outer = ray.get(pool.submit(0, items, build.sampling(trainer.cfg)), timeout=60)
        assert len(outer) == 1 and isinstance(outer[0], ray.ObjectRef)  # put by the worker
        batch = ray.get(outer[0])
        arrays = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
        assert arrays["tokens"].dtype == np.int32 and arrays["tokens"].size > 0
        # zero-copy reads of the shared-memory object store come back read-only
        assert not arrays["tokens"].flags.writeable and not arrays["versions"].flags.writeable
        groups = groups_from_arrays(batch)
        assert [g.group_id for g in groups] == [0, 1]
        assert all(len(g.episodes) == N for g in groups)

        os.kill(pid0, signal.SIGSTOP)  # stops answering, does not die
        t0 = time.perf_counter()
        with pytest.raises(WorkerLost, match="health check within 2s"):
            pool.run(0, items, build.sampling(trainer.cfg))
        assert time.perf_counter() - t0 < 2.0 + 3.0
        pool.replace(0, "did not answer")
        pid1 = pool.pids()[0]
        assert pid1 not in (pid0, os.getpid()) and pool.restarts == 1
        assert [g.group_id for g in pool.run(0, items, build.sampling(trainer.cfg))] == [0, 1]

        # A worker that hangs while idle must not hold a weight update back (nor, with it,
        # admission): the parameter server kills it after an unanswered ping and goes on.
        os.kill(pid1, signal.SIGSTOP)
        t0 = time.perf_counter()
        pool.update_weights(1, Weights(params=trainer.learner.params())).wait(timeout=30)
        assert time.perf_counter() - t0 < 2 * 2.0 + 5.0
        with pytest.raises(WorkerLost, match="died"):  # its dispatcher's next call finds it
            pool.run(0, items, build.sampling(trainer.cfg))
        with pytest.raises(RolloutWorkerError) as err:  # max_restarts=1 already used
            pool.replace(0, "died")
        msg = str(err.value)
        assert f"pid {pid1}" in msg and "rollout-0.r1" in msg
        assert os.path.join(str(tmp_path), "rollout-0.r1.log") in msg
        with open(os.path.join(str(tmp_path), "rollout-0.r1.log")) as f:
            assert f"pid {pid1}" in f.read()
    finally:
        try:
            os.kill(pid0, signal.SIGCONT)
        except ProcessLookupError:
            pass
        pool.close()
    assert ray.is_initialized()  # the pool did not shut down a cluster it did not start


@pytest.mark.slow
def test_killed_learner_actor_past_the_restart_limit_fails_the_run_naming_it(cluster, tmp_path):
    """With trainer.ray.max_learner_restarts=0, SIGKILL of the learner actor's process mid-run
    fails the run at once (no hang) with an error naming the learner's pid, its log and the
    limit, and leaves no rollout worker behind."""
    trainer = Trainer(
        _cfg(
            str(tmp_path),
            "learner",
            "trainer.total_updates=50",
            "trainer.ray.max_learner_restarts=0",
        )
    )
    pid = trainer.learner.pid
    assert pid != os.getpid() and os.path.exists(f"/proc/{pid}")
    seen: dict = {}

    def kill_learner():
        seen["t"] = time.perf_counter()
        os.kill(pid, signal.SIGKILL)

    with pytest.raises(LearnerError) as err:
        trainer.run(**_watch(seen, 2, kill_learner))
    took = time.perf_counter() - seen["t"]
    msg = str(err.value)
    assert f"learner actor (pid {pid}," in msg and "died" in msg, msg
    assert "0 of trainer.ray.max_learner_restarts=0 restarts used" in msg, msg
    assert os.path.join(trainer.run_dir, "logs", "learner.log") in msg
    assert took < 30, f"the run took {took:.1f}s to fail after the learner died"
    assert all(_gone(p) for p in seen["pool"].pids())  # the workers were ended with the run


@pytest.mark.slow
def test_stopped_run_resumes_without_losing_finished_episodes(cluster, tmp_path):
    """Stop after 2 updates with finished-untrained groups in the buffer; the resumed run trains
    exactly those (never dispatched again), re-dispatches only the rest, continues at version 3."""
    first, total = 2, 4
    root = str(tmp_path)
    trainer = Trainer(_cfg(root, "resume", f"trainer.total_updates={first}"))
    save = trainer.save

    def save_with_buffered(step, coord, buffer):
        if step == first:  # make the scenario certain: a finished, untrained group exists
            t0 = time.perf_counter()
            while not buffer.state()[1] and time.perf_counter() - t0 < 60:
                time.sleep(0.05)
        return save(step, coord, buffer)

    trainer.save = save_with_buffered
    trainer.run()
    saved = load_groups(os.path.join(root, "resume", "checkpoints", f"groups_{first}.npz"))
    assert saved and min(saved) >= first * B  # finished but untrained at the stop
    before = trained_episodes(os.path.join(root, "resume"))
    assert sorted({g for g, _ in before}) == list(range(first * B))

    trainer = Trainer(_cfg(root, "resume", f"trainer.total_updates={total}"), resume=True)
    assert trainer.learner.version == first
    dispatched: list[int] = []
    group_work = trainer.group_work

    def record(admitted):
        dispatched.extend(g for g, _ in admitted)
        return group_work(admitted)

    trainer.group_work = record
    trainer.run()
    rows = metric_rows(os.path.join(root, "resume"))
    assert [r["step"] for r in rows] == list(range(total + 1))  # each version exactly once
    assert all(r["version"] == r["step"] for r in rows)
    trained = trained_episodes(os.path.join(root, "resume"))  # raises on any episode trained twice
    assert sorted(trained) == [(g, i) for g in range(total * B) for i in range(N)]
    for gid, group in saved.items():  # the saved episodes themselves were trained
        for i, e in enumerate(group.episodes):
            d = trained[(gid, i)]
            assert d["versions"] == list(e.version_span) and d["completion"] == e.completion_text
    # only what was not finished at the stop is generated again; the saved groups are not
    assert not set(dispatched) & set(saved)
    assert set(range(first * B, total * B)) - set(saved) <= set(dispatched)
    last = rows[-1]
    assert last["buffer/trained"] == total * B
    assert last["buffer/finished"] == total * B + last["buffer/size"]  # each finished once


@pytest.mark.slow
def test_two_learner_hosts_learn_in_lockstep_and_resume(cluster, tmp_path):
    """learner.hosts=2: two learner actors joined by jax.distributed (a 2 x 2 mesh, fsdp across
    them) train; each logs its host id, the checkpoint records two writers, both actors end with
    the run; `--resume` on two hosts continues from that checkpoint to the end, every finished
    episode trained exactly once, and held-out accuracy rose (the longtail task: answers of
    mostly even digits, learnable in a few updates from a random model)."""
    first, total, P = 4, 10, 8
    over = [
        "learner.hosts=2",
        "learner.mesh.fsdp=2",
        "learner.mesh.tensor=2",
        "task.name=longtail",
        "task.options={min_tokens: 8, max_tokens: 8}",
        "task.num_eval=32",
        f"rollout.prompts_per_update={P}",
        f"rollout.batch_size={P * N}",
        f"logging.save_episodes={P * N}",
        f"trainer.eval_every={first}",
    ]
    cfg = _cfg(str(tmp_path), "hosts", f"trainer.total_updates={first}", *over)
    trainer = Trainer(cfg)
    learner = trainer.learner
    assert learner.hosts == 2 and len(set(learner.pids)) == 2
    assert os.getpid() not in learner.pids and len(learner.devices) == 4
    trainer.run()
    run_dir = trainer.run_dir
    for i, pid in enumerate(learner.pids):
        with open(os.path.join(run_dir, "logs", f"learner-{i}.log")) as f:
            text = f.read()
        assert f"learner: pid {pid}, host {i} of 2," in text
        assert f"learner host {1 - i} (pid {learner.pids[1 - i]} on " in text  # the roster
        assert _gone(pid)  # ended with the run
    with open(os.path.join(run_dir, "checkpoints", str(first), "layout", "metadata")) as f:
        assert '"hosts": 2' in f.read()

    cfg = _cfg(str(tmp_path), "hosts", f"trainer.total_updates={total}", *over)
    trainer = Trainer(cfg, resume=True)
    assert trainer.learner.version == first and trainer.learner.hosts == 2
    trainer.run()
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(total + 1))  # each version exactly once
    assert all(np.isfinite(r["loss/loss"]) for r in rows[1:])
    trained = trained_episodes(run_dir)  # raises on any episode trained twice
    assert sorted(trained) == [(g, i) for g in range(total * P) for i in range(N)]
    with open(os.path.join(run_dir, "checkpoints", str(total), "layout", "metadata")) as f:
        assert '"hosts": 2' in f.read()
    evals = {r["step"]: (r["eval/accuracy"], r["eval/reward"]) for r in rows if "eval/reward" in r}
    print(f"two learner hosts: held-out (accuracy, reward) by update {evals}")
    assert evals[total][0] >= evals[0][0] + 0.25, evals
    assert evals[total][1] >= evals[0][1] + 0.1, evals


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "weight_sync,learner",
    [
        ("disk", ["learner.hosts=2", "learner.mesh.fsdp=2", "learner.mesh.tensor=2"]),
        ("direct", []),
    ],
)
def test_vllm_hosts_driven_by_a_ray_worker_survive_a_killed_host(
    cluster, tmp_path, weight_sync, learner
):
    """A rollout worker actor launching and driving a real vLLM host; SIGKILL of the host
    mid-run: the worker fails its health check, is replaced (a new host), the lost groups are
    re-dispatched, and every finished episode is trained exactly once. disk: the weights of a
    two-host learner, gathered to its host 0 and published by the parameter server actor as HF
    directories the host reloads; direct: the worker streams the flat params the parameter
    server sends to its host, and the directories (a replacement's start) are written after."""
    total = 4
    cfg = _cfg(
        str(tmp_path),
        "vllm",
        *learner,
        f"rollout.vllm.weight_sync={weight_sync}",
        "rollout.engine=vllm",
        "rollout.vllm.ready_timeout_s=400",
        f"trainer.total_updates={total}",
        "trainer.ray.num_workers=1",
        "trainer.ray.health_deadline_s=10",
        "trainer.deadline_s=400",
    )
    trainer = Trainer(cfg)
    seen: dict = {}

    def kill_host():  # after update 1: the vLLM server and its engine core
        info = ray.get(seen["pool"].workers[0].handle.info.remote())
        seen["worker"], (_, host_pid, host_log) = info["pid"], info["hosts"][0]
        with open(f"/proc/{host_pid}/stat") as f:  # the server is the worker's child
            seen["host_parent"] = int(f.read().rsplit(")", 1)[1].split()[1])
        seen["host"], seen["host_log"] = host_pid, host_log
        os.killpg(host_pid, signal.SIGKILL)

    trainer.run(**_watch(seen, 1, kill_host))

    assert seen["host_parent"] == seen["worker"] != os.getpid()
    assert seen["host_log"] == os.path.join(trainer.run_dir, "logs", "rollout-0-vllm-0.log")
    assert _gone(seen["host"])
    pids = {os.getpid(), *trainer.learner.pids, seen["pool"].param_server_pid, seen["worker"]}
    assert len(pids) == 3 + len(trainer.learner.pids)  # driver, learner host(s), param server,
    assert len(trainer.learner.pids) == (2 if learner else 1)  # and the rollout worker
    rows = metric_rows(trainer.run_dir)
    assert [r["step"] for r in rows] == list(range(total + 1))  # the run completed
    last = rows[-1]
    streamed = last["rollout/weight_updates_streamed"]  # by the replacement, live at the end
    assert (streamed >= 1) if weight_sync == "direct" else streamed == 0, streamed
    assert last["rollout/restarts"] == 1 and last["rollout/workers_lost"] == 1
    assert "health check" in seen["pool"].lost[0] and "vLLM host" in seen["pool"].lost[0]
    trained = trained_episodes(trainer.run_dir)  # raises on any episode trained twice
    assert sorted(trained) == [(g, i) for g in range(total * B) for i in range(N)]
    assert max(max(d["versions"]) for d in trained.values()) >= 2  # sampled on published ones
    assert last["buffer/trained"] == total * B
    published = sorted(os.listdir(os.path.join(trainer.run_dir, "weights")))
    assert published[-1] == f"v{total:06d}" and "LATEST" in published  # by the param server
    replacement = seen["pool"].workers[0]
    assert replacement.name == "rollout-0.r1" and _gone(replacement.pid)  # closed with the run


def test_ray_config_errors_name_key_value_and_valid_choices():
    ok = C.load(os.path.join(os.path.dirname(__file__), "..", "configs", "ray.yaml"))
    assert ok.trainer.transport == "ray" and ok.trainer.ray.num_workers == 2
    with pytest.raises(
        C.ConfigError, match=r"trainer\.ray\.num_workers: invalid value 0; must be > 0"
    ):
        C.load(None, ["trainer.transport=ray", "trainer.ray.num_workers=0"])
    with pytest.raises(C.ConfigError, match=r"trainer\.ray\.max_restarts: invalid value -1"):
        C.load(None, ["trainer.transport=ray", "trainer.ray.max_restarts=-1"])
    with pytest.raises(
        C.ConfigError, match=r"trainer\.ray\.max_learner_restarts: invalid value -1; must be >= 0"
    ):
        C.load(None, ["trainer.transport=ray", "trainer.ray.max_learner_restarts=-1"])
    with pytest.raises(C.ConfigError, match=r"rollout\.vllm\.urls: \['http://h:1'\] with trai"):
        C.load(
            None, ["trainer.transport=ray", "rollout.engine=vllm", "rollout.vllm.urls=[http://h:1]"]
        )
    with pytest.raises(C.ConfigError, match=r"trainer\.ray\.learner_gpus: invalid value -1"):
        C.load(None, ["trainer.transport=ray", "trainer.ray.learner_gpus=-1"])
    with pytest.raises(C.ConfigError, match=r"trainer\.transport: invalid value 'rey'.*'ray'"):
        C.load(None, ["trainer.transport=rey"])
