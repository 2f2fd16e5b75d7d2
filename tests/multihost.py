"""A multi-host learner on one machine: N CPU processes of 2 devices each joined by
jax.distributed (gloo), launched from a test with a deadline on every wait; and the program each
process runs (`python tests/multihost.py MODE OUT_DIR`), whose model and batch the tests rebuild
in one process for the reference."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES_PER_HOST = 2
MESH = (1, 2, 2)  # data, fsdp, tensor: fsdp across the hosts, tensor within each


def model_config():
    """A one-layer tiny model whose dims divide the 2 x 2 mesh."""
    from models import tiny

    return tiny(num_hidden_layers=1, hidden_size=64, intermediate_size=128, head_dim=16)


def step_cfg():
    """Decoupled PPO over two minibatches: the update and the proximal log-probs both run."""
    from rl.algorithms.losses import LossConfig
    from rl.learner import StepConfig

    return StepConfig(
        loss="decoupled_ppo", loss_cfg=LossConfig(decoupled_cap=5.0), needs_proximal=True
    )


def batch(seed: int = 0):
    """Eight episodes (prompt, generated tokens, a masked observation) as one TrainBatch."""
    from rl.learner import make_batch
    from rl.types import Episode

    rng = np.random.RandomState(seed)
    vocab = model_config().vocab_size
    eps = []
    for i, n in enumerate((30, 12, 21, 9, 25, 17, 31, 14)):
        p = 3 + i % 4
        mask = np.zeros(n, np.int8)
        mask[p:] = 1
        mask[p + 2 : p + 4] = 0
        behavior = np.where(mask > 0, -4.0 + 0.5 * rng.standard_normal(n), 0.0)
        versions = np.where(mask > 0, 0, -1)
        eps.append(Episode(f"e{i}", rng.randint(0, vocab, n), mask, behavior, versions, p, 0.0))
    adv = rng.standard_normal(len(eps)).astype(np.float32)
    return make_batch(eps, adv, row_len=32)


def learner(mesh, seed: int = 0):
    """The learner every process (and the one-process reference) builds: AdamW, same seed."""
    from models import create_model
    from rl.learner import Learner, make_optimizer

    model = create_model(model_config(), mesh, seed=seed)
    return Learner(model, make_optimizer(1e-2, total_steps=10), mesh=mesh, step_cfg=step_cfg())


def host_state(state) -> dict:
    """{path: numpy} of a learner state, gathered to process 0 (None elsewhere)."""
    import jax
    from flax import nnx

    from rl import distributed

    pure = distributed.gather_to_primary(nnx.to_pure_dict(state))
    if pure is None or any(x is None for x in jax.tree.leaves(pure, is_leaf=lambda x: x is None)):
        return {}
    leaves = jax.tree.flatten_with_path(pure)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


# ---------------------------------------------------------------------------------------------
# Launching from a test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, out_dir: str, hosts: int = 2, *args: str) -> list[subprocess.Popen]:
    """Starts `hosts` processes of `mode`, each with 2 CPU devices, logs at out_dir/host-<i>.log."""
    port = free_port()
    procs = []
    for i in range(hosts):
        env = dict(os.environ)
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(hosts),
            JAX_PROCESS_ID=str(i),
            PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
        )
        log = open(os.path.join(out_dir, f"host-{i}.log"), "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), mode, out_dir, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        )
        log.close()
    return procs


def log_text(out_dir: str, i: int) -> str:
    with open(os.path.join(out_dir, f"host-{i}.log")) as f:
        return f.read()


def wait_all(procs, out_dir: str, deadline_s: float) -> list[int]:
    """Exit codes of every process; past the deadline all are killed and the test fails."""
    t0 = time.monotonic()
    codes = []
    for i, p in enumerate(procs):
        try:
            codes.append(p.wait(timeout=max(0.0, deadline_s - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = "\n".join(
                f"--- host {j}\n{log_text(out_dir, j)[-3000:]}" for j in range(len(procs))
            )
            raise AssertionError(f"host {i} still running after {deadline_s}s\n{logs}") from None
    return codes


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)


# ---------------------------------------------------------------------------------------------
# What each process runs


def main(mode: str, out_dir: str) -> None:
    from rl import distributed

    hosts = int(os.environ["JAX_NUM_PROCESSES"])
    log = os.path.join(out_dir, f"host-{os.environ['JAX_PROCESS_ID']}.log")
    me = distributed.initialize(hosts, log=log, deadline_s=60.0)
    import jax

    from models import make_mesh
    from rl.checkpoint import Checkpointer

    print(f"host {me.process_id}: pid {me.pid}, devices {jax.local_devices()}", flush=True)
    devices = distributed.process_devices(DEVICES_PER_HOST)
    mesh = make_mesh(*MESH, devices=devices)
    try:
        if mode == "update":
            lrn = learner(mesh)
            met = lrn.update(batch(), minibatches=2)
            np.savez(os.path.join(out_dir, f"metrics-{me.process_id}.npz"), **met)
            state = host_state(lrn.state)
            if state:
                np.savez(os.path.join(out_dir, "state.npz"), **state)
        elif mode == "save":
            lrn = learner(mesh)
            lrn.update(batch(), minibatches=2)
            ckpt = Checkpointer(os.path.join(out_dir, "ckpt"), async_save=True)
            ckpt.save(1, lrn.state, {"version": 1}, {})
            ckpt.close()
            state = host_state(lrn.state)
            if state:
                np.savez(os.path.join(out_dir, "saved.npz"), **state)
        elif mode == "restore":
            lrn = learner(mesh, seed=1)  # other values: only the restore can make them equal
            ckpt = Checkpointer(os.path.join(out_dir, "ckpt"))
            state, meta, _ = ckpt.restore(lrn.state)
            ckpt.close()
            state = host_state(state)
            if state:
                np.savez(os.path.join(out_dir, "restored.npz"), **state, version=meta["version"])
        elif mode == "loop":  # updates until a host is lost
            lrn = learner(mesh)
            b = batch()
            lrn.update(b, minibatches=2)
            open(os.path.join(out_dir, f"ready-{me.process_id}"), "w").close()
            while True:
                lrn.update(b, minibatches=2)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except distributed.HostLost as e:
        distributed.fail(e)
    print(f"host {me.process_id}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
