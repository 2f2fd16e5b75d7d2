"""A learner over two hosts without Ray (trainer.transport local, learner.hosts 2): the same
`python -m launch.train` on two CPU processes of two devices each (gloo), process 0 training and
process 1 following its learner calls. It trains to the metrics of one process of four devices,
resumes from its checkpoint, stops on SIGTERM to every host, fails naming a killed host, and
says which environment it lacks."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from multihost import free_port, kill_all, log_text, wait_all
from run_files import metric_rows, trained_episodes

from rl import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 120.0  # trainer.deadline_s, and each run's wall-clock limit: processes compiling
RUN_S = 420.0  # a whole run of two processes on a shared CPU

# A sync run with the batch-invariant sampler and fixed seeds: its rollouts are bit-identical
# whatever the learner's layout, so the learner's metrics of two layouts can be compared. The
# longtail task's reward varies inside a group (nonzero advantages and gradients); the warm
# start switches step and optimizer (calls every host must follow too).
BASE = [
    "sft.steps=2",
    "sft.batch_size=8",
    "sft.continue_optimizer=false",
    "task.name=longtail",
    "task.options.min_tokens=4",
    "task.options.max_tokens=8",
    "task.num_eval=4",
    "rollout.prompts_per_update=2",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=8",
    "rollout.batch_invariant=true",
    "algorithm.filter_zero_advantage=false",
    "trainer.mode=sync",
    "trainer.eval_every=0",
    "trainer.placement=in_process",
    f"trainer.deadline_s={DEADLINE_S:g}",
    "learner.mesh.fsdp=2",
    "learner.mesh.tensor=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.save_episodes=8",  # every trained episode is dumped
    "seed=1",
]
COMPARED = ("loss/loss", "loss/grad_norm", "loss/entropy", "loss/logp_mean", "loss/pg_loss")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The subprocesses' environment: CPU, one persistent compilation cache for the module."""
    out = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    out["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
    out["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    for k in [k for k in out if k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))]:
        del out[k]  # the tests name their hosts themselves
    return out


def _args(root, *extra) -> list[str]:
    cmd = [sys.executable, "-m", "launch.train", "--set", f"run_root={root}", "--set", "name=r"]
    for kv in (*BASE, *extra):
        cmd += ["--set", kv]
    return cmd


def _two_hosts(root, env, *extra, resume=False) -> list[subprocess.Popen]:
    """The same command on two processes of two CPU devices, joined through the environment;
    process i's output in root/host-<i>.log."""
    port = free_port()
    procs = []
    for i in range(2):
        e = dict(
            env,
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
        )
        cmd = _args(root, "learner.hosts=2", *extra) + (["--resume"] if resume else [])
        with open(os.path.join(root, f"host-{i}.log"), "w") as log:
            procs.append(
                subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


def _run_two(root, env, *extra, resume=False) -> None:
    procs = _two_hosts(root, env, *extra, resume=resume)
    try:
        codes = wait_all(procs, str(root), RUN_S)
    finally:
        kill_all(procs)
    follower = os.path.join(root, "r", "logs", "learner-1.log")
    logs = log_text(str(root), 0)[-3000:] + "\n--- host 1\n" + _read(follower)[-3000:]
    assert codes == [0, 0], logs


def _read(path) -> str:
    if not os.path.exists(path):
        return f"({path} missing)"
    with open(path) as f:
        return f.read()


@pytest.mark.slow
def test_two_hosts_train_resume_and_equal_one_process(tmp_path, env):
    """Two hosts train 1 update, stop, and --resume to update 2; every logged loss, gradient
    norm, entropy and log-prob equals a one-process four-device run of 2 updates within 1e-6,
    on the same rollouts (every trained episode's tokens and reward equal)."""
    ref_root, two_root = tmp_path / "one", tmp_path / "two"
    ref_root.mkdir()
    two_root.mkdir()
    one = subprocess.run(
        _args(ref_root, "trainer.total_updates=2"),
        env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert one.returncode == 0, one.stderr[-3000:]

    _run_two(two_root, env, "trainer.total_updates=1")
    run = two_root / "r"
    follower = _read(run / "logs" / "learner-1.log")
    first = follower.splitlines()[0]
    assert first.startswith("learner hosts: learner host 0 (pid "), follower[:2000]
    assert f"log: {run / 'logs' / 'learner-1.log'})" in first, first
    assert "learner host 1: done" in follower, follower[-2000:]
    assert {"0", "1"} <= set(os.listdir(run / "checkpoints"))

    _run_two(two_root, env, "trainer.total_updates=2", resume=True)
    got, want = metric_rows(run), metric_rows(ref_root / "r")
    assert [r["step"] for r in got] == [0, 1, 2]  # resumed at 1: no warm start, no step again
    assert [r["step"] for r in want] == [0, 1, 2]
    assert abs(got[0]["sft/loss"] - want[0]["sft/loss"]) <= 1e-6
    for g, w in zip(got[1:], want[1:]):
        for k in COMPARED:
            assert abs(g[k] - w[k]) <= 1e-6, (g["step"], k, g[k], w[k])
    assert all(r["loss/grad_norm"] > 0.1 for r in got[1:])  # the updates trained something
    assert got[1]["loss/logp_mean"] != got[2]["loss/logp_mean"]  # and moved the policy

    mine, theirs = trained_episodes(run), trained_episodes(ref_root / "r")
    assert sorted(mine) == sorted(theirs) and len(mine) == 16
    for key, e in mine.items():
        r = theirs[key]
        assert (e["token_ids"], e["reward"]) == (r["token_ids"], r["reward"]), key
        np.testing.assert_allclose(e["behavior_logp"], r["behavior_logp"], rtol=0, atol=1e-6)
    assert len({e["reward"] for e in mine.values()}) > 1  # advantages were not all zero

    replay = subprocess.run(
        [sys.executable, "-m", "launch.train", "--replay", str(run)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert replay.returncode == 2, replay.stderr[-3000:]
    assert "replay error: learner.hosts: 2 in this run" in replay.stderr, replay.stderr[-3000:]


def _wait_rows(run, n: int, procs, root) -> None:
    """Until the run has logged n metric rows (every process still running)."""
    t0 = time.monotonic()
    while not ((run / "metrics.jsonl").exists() and len(metric_rows(run)) >= n):
        assert time.monotonic() - t0 < RUN_S, log_text(str(root), 0)[-3000:]
        assert all(p.poll() is None for p in procs), log_text(str(root), 0)[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_stops_every_host_and_a_killed_follower_fails_host_0(tmp_path, env):
    """SIGTERM to both processes (a preemption, scancel): process 0 checkpoints with process 1
    and both exit 0. --resume continues after that checkpoint; SIGKILL of process 1 then makes
    process 0 exit 1 within the deadline, its last line the error naming host 1's pid and log."""
    run, total = tmp_path / "r", "trainer.total_updates=8"
    procs = _two_hosts(tmp_path, env, total)
    try:
        _wait_rows(run, 2, procs, tmp_path)  # update 1 logged
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = wait_all(procs, str(tmp_path), DEADLINE_S)
    finally:
        kill_all(procs)
    text, follower = log_text(str(tmp_path), 0), _read(run / "logs" / "learner-1.log")
    assert codes == [0, 0], text[-3000:] + "\n--- host 1\n" + follower[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("preempted (SIGTERM) at version "), text[-3000:]
    stopped = int(last.split("at version ")[1].split(":")[0])
    assert str(stopped) in os.listdir(run / "checkpoints")
    assert "SIGTERM: host 0 checkpoints the run" in follower, follower[-3000:]
    assert follower.strip().endswith("learner host 1: done"), follower[-3000:]

    procs = _two_hosts(tmp_path, env, total, resume=True)
    try:
        _wait_rows(run, stopped + 2, procs, tmp_path)  # one update after the checkpoint
        victim = procs[1]
        victim.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        code = procs[0].wait(timeout=DEADLINE_S + 30)
        took = time.monotonic() - t_kill
    finally:
        kill_all(procs)
    steps = [r["step"] for r in metric_rows(run)]
    assert steps[: stopped + 2] == list(range(stopped + 2))  # resumed after the checkpoint
    text = log_text(str(tmp_path), 0)
    assert code == 1, text[-3000:]
    assert took < DEADLINE_S, f"{took:.1f}s"
    last = text.strip().splitlines()[-1]
    log = run / "logs" / "learner-1.log"
    assert last.startswith("error: HostLost: "), text[-3000:]
    assert f"lost learner host 1 (pid {victim.pid} on " in last and f"log: {log})" in last, last


def test_missing_coordinator_is_a_config_error_naming_the_variables(tmp_path, env):
    """learner.hosts 2 on the local transport with no coordinator in the environment (and no
    cluster JAX detects): exit 2 before any work, naming the variables to set."""
    e = {k: v for k, v in env.items() if k not in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    out = subprocess.run(
        _args(tmp_path, "learner.hosts=2"), env=e, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("config error: learner.hosts: 2 with trainer.transport 'local'"), err
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        assert var in err, err
    assert not (tmp_path / "r").exists()  # nothing was written
    e["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{free_port()}"  # no process id: still unknown
    out = subprocess.run(
        _args(tmp_path, "learner.hosts=2"), env=e, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "its hosts: JAX_PROCESS_ID unset" in out.stderr, out.stderr[-3000:]


def test_hosts_with_local_transport_config():
    """learner.hosts > 1 is valid with the local transport, but not with a rollout device split
    (the learner's mesh takes every device); the error names the key, value and what is valid."""
    mesh = ["learner.mesh.fsdp=2", "learner.hosts=2"]
    assert C.load(None, mesh).learner.hosts == 2
    with pytest.raises(C.ConfigError, match=r"trainer\.placement: 'split' with learner\.hosts 2"):
        C.load(None, [*mesh, "trainer.placement=split"])
    with pytest.raises(
        C.ConfigError, match=r"trainer\.rollout_devices: \[0\] with learner\.hosts 2.*valid: "
    ):
        C.load(None, [*mesh, "trainer.rollout_devices=[0]"])


class _Store:
    """jax.distributed's key-value client, in memory: what a Channel and a Follower use."""

    def __init__(self, error: str = ""):
        self.kv: dict[str, bytes | str] = {}
        self.error = error  # what every blocking read raises (a timeout, the service gone)

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv, key
        self.kv[key] = value

    key_value_set_bytes = key_value_set

    def key_value_delete(self, key):
        self.kv.pop(key, None)

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if self.error or key not in self.kv:
            raise RuntimeError(self.error or f"DEADLINE_EXCEEDED: GetKeyValue() {key}")
        return self.kv[key]


LEAD = ("learner host 0 (pid 4242 on node-a; log: /runs/r/host-0.log)", 4242, "/runs/r/host-0.log")


def _follower(store, deadline_s=60.0):
    from rl import distributed, lockstep

    f = lockstep.Follower.__new__(lockstep.Follower)  # no coordination service, no thread
    f.client, f.seq, f.deadline_s, f._heard = store, 0, deadline_s, time.monotonic()
    f.lead = distributed.Host(0, LEAD[1], "node-a", LEAD[2])
    f.me = distributed.Host(1, 4343, "node-b", "/runs/r/logs/learner-1.log")
    return f


def test_calls_arrive_in_order_and_their_keys_go_once_every_host_read_them(monkeypatch):
    from rl import distributed, lockstep

    store = _Store()
    monkeypatch.setattr(distributed, "client", lambda: store)
    monkeypatch.setattr(lockstep, "BEAT_S", 0.01)
    chan = lockstep.Channel()
    follower = _follower(store)
    batch = {"inputs": np.arange(6).reshape(2, 3)}
    assert [chan.call("set_version", 3), chan.call("update", batch, 2)] == [0, 1]
    method, args = follower.next_call()
    assert (method, args) == ("set_version", (3,))
    method, (got, minibatches) = follower.next_call()
    assert method == "update" and minibatches == 2
    np.testing.assert_array_equal(got["inputs"], batch["inputs"])
    chan.read_by_all(1)  # the update (a collective) completed: both calls were read
    assert not [k for k in store.kv if k.startswith(f"{lockstep.PREFIX}/call/")]
    chan.call("wait")
    chan.end(failed=False)
    assert [follower.next_call() for _ in range(2)] == [("wait", ()), ("end", (False,))]
    calls = sorted(k for k in store.kv if k.startswith(f"{lockstep.PREFIX}/call/"))
    assert calls == [f"{lockstep.PREFIX}/call/2", f"{lockstep.PREFIX}/call/3"]
    assert int(store.kv[f"{lockstep.PREFIX}/beat"]) >= 1  # the keep-alive ran
    chan.end(failed=True)  # idempotent: no second end
    assert f"{lockstep.PREFIX}/call/4" not in store.kv


def test_follower_fails_naming_host_0_when_it_is_gone_or_silent():
    from rl.distributed import HostLost

    gone = _follower(_Store("UNAVAILABLE: failed to connect to all addresses"))
    with pytest.raises(HostLost, match=r"waiting for learner call 0: lost ") as err:
        gone.next_call()
    assert LEAD[0] in str(err.value) and "UNAVAILABLE" in str(err.value)

    silent = _follower(_Store(), deadline_s=0.3)  # no call and no keep-alive
    t0 = time.monotonic()
    with pytest.raises(HostLost, match=r"no call and no keep-alive from ") as err:
        silent.next_call()
    assert 0.3 <= time.monotonic() - t0 < 5
    assert LEAD[0] in str(err.value) and "trainer.deadline_s=0.3s" in str(err.value)
