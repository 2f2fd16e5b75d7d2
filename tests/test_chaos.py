"""The chaos suite: short real training runs under a seeded schedule of faults (real signals to
real processes, an injected OSError around real Orbax, real damage to a real checkpoint). Each
run must complete, or, for a fault the design does not survive in-run, fail with its named error
within its deadline and complete on --resume; and every run keeps the invariants of
chaos.check_run (versions once each, every group trained exactly once or counted). The schedule
comes from CHAOS_SEED (default chaos.DEFAULT_SEED) and is printed first: a failure's captured
output names the seed that replays it."""

import signal
import threading
import time

import pytest
import ray
from chaos import Faults, Schedule, check_run, gone, release

from rl import config as C
from rl.trainer import Trainer

B, N = 2, 4  # groups per update, samples per group
ETA = 1
HEALTH_S = 6.0  # trainer.ray.health_deadline_s of the Ray runs: a SIGSTOP is found within it
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

    def on_update(version, row):
        for name in faults.at:
            faults.recover(name)
        if version == kill_at and "killer" not in seen:
            seen["killer"] = threading.Thread(target=kill_busy, daemon=True)
            seen["killer"].start()
        if version == stop_at and "stopped" not in seen:
            seen["killer"].join(60)
            seen["stopped"] = seen["pool"].pids()[stop_slot]
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
    assert any(f"health check within {HEALTH_S:g}s" in why for why in pool.lost), pool.lost
    assert gone(seen["killed"]) and gone(seen["stopped"])
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
    last = check_run(trainer.run_dir, total=total, groups_per_update=B, group_size=N, eta=ETA)
    assert "sigstop_learner" in seen, "the schedule's SIGSTOP never ran"
    assert last["learner/restarts"] == 2 and last["rollout/restarts"] == 0
    assert seen["pool"].pids() == seen["workers"]  # the rollout workers kept running
    learner = trainer.learner
    assert "died" in learner.lost[0], learner.lost
    assert f"health check within trainer.ray.health_deadline_s={HEALTH_S:g}s" in learner.lost[1]
    assert f"pid {seen['sigstop_learner']}" in learner.lost[1]
    assert gone(seen["sigkill_learner"]) and gone(seen["sigstop_learner"])  # killed, not left
    assert len({seen["sigkill_learner"], seen["sigstop_learner"], learner.pid}) == 3
    # the hang was found within the health deadline and the new learner trained within slack
    assert faults.took("sigstop_learner") < HEALTH_S + SLACK_S, faults.took("sigstop_learner")
