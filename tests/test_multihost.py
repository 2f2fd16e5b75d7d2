"""The learner over two processes of two CPU devices each (jax.distributed, gloo): one update
equals the one-process four-device update; a checkpoint written by two processes restores bit-equal
in two processes and in one; a misfit restore says why; a killed host fails the other, naming it."""

import os
import signal
import time

import jax
import numpy as np
import pytest
from multihost import MESH, batch, host_state, kill_all, launch, learner, log_text, wait_all

from models import make_mesh
from rl import config as C
from rl.checkpoint import Checkpointer

DEADLINE_S = 240.0  # two processes compiling on a shared CPU


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the module's processes: each test's programs are
    compiled once, by the first process group that runs them."""
    path = str(tmp_path_factory.mktemp("jax-cache"))
    keys = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict(zip(keys, (path, "0"))))
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _mesh4():
    return make_mesh(*MESH, devices=jax.devices()[:4])


def _load(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
def test_two_hosts_update_equals_one_process(tmp_path):
    out = str(tmp_path)
    procs = launch("update", out)
    try:
        assert wait_all(procs, out, DEADLINE_S) == [0, 0], log_text(out, 0) + log_text(out, 1)
    finally:
        kill_all(procs)
    ref = learner(_mesh4())
    before = host_state(ref.state)
    met = ref.update(batch(), minibatches=2)
    want = host_state(ref.state)
    got = _load(os.path.join(out, "state.npz"))
    assert sorted(got) == sorted(want)
    moved = max(float(np.abs(want[k] - before[k]).max()) for k in want)
    assert moved > 1e-3  # the update changed the parameters: equality below is not vacuous
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    for i in range(2):  # both hosts report the same metrics, equal to the reference's
        m = _load(os.path.join(out, f"metrics-{i}.npz"))
        for k in ("loss", "pg_loss", "grad_norm", "entropy", "num_tokens"):
            assert abs(float(m[k]) - met[k]) <= 1e-6, (i, k, float(m[k]), met[k])
    assert met["grad_norm"] > 0 and met["loss"] != 0


@pytest.mark.slow
def test_two_host_checkpoint_restores_bit_equal(tmp_path):
    out = str(tmp_path)
    for mode in ("save", "restore"):
        procs = launch(mode, out)
        try:
            assert wait_all(procs, out, DEADLINE_S) == [0, 0], log_text(out, 0) + log_text(out, 1)
        finally:
            kill_all(procs)
    saved = _load(os.path.join(out, "saved.npz"))
    restored = _load(os.path.join(out, "restored.npz"))
    assert int(restored.pop("version")) == 1
    assert sorted(saved) == sorted(restored)
    for k in saved:
        np.testing.assert_array_equal(restored[k], saved[k], err_msg=k)

    # one process of four devices: another process count, and the arrays divide over its mesh
    fresh = learner(_mesh4(), seed=1)
    ckpt = Checkpointer(os.path.join(out, "ckpt"))
    state, meta, _ = ckpt.restore(fresh.state)
    one = host_state(state)
    assert meta == {"version": 1}
    for k in saved:
        np.testing.assert_array_equal(one[k], saved[k], err_msg=k)

    # a learner the checkpoint cannot fill: the error names both layouts and the checkpoint
    from models import create_model, tiny
    from rl.learner import Learner, make_optimizer

    other = tiny(num_hidden_layers=1, hidden_size=64, intermediate_size=64, head_dim=16)
    wrong = Learner(create_model(other, _mesh4()), make_optimizer(1e-2), mesh=_mesh4())
    with pytest.raises(ValueError) as err:
        ckpt.restore(wrong.state)
    ckpt.close()
    msg = str(err.value)
    assert "written by 2 learner host(s) with 4 device(s)" in msg, msg
    assert "restored by 1 learner host(s) with 4 device(s)" in msg, msg
    assert os.path.join(out, "ckpt", "1") in msg


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_host_fails_the_other_naming_it(tmp_path, victim):
    """SIGKILL of one host mid-update: the survivor exits well within the deadline. Host 1
    lost: HostLost naming its process id, pid and log. Host 0 lost (the coordination service):
    JAX ends the survivor itself, and its log names host 0 (the roster written at start)."""
    out = str(tmp_path)
    procs = launch("loop", out)
    try:
        t0 = time.monotonic()
        while not all(os.path.exists(os.path.join(out, f"ready-{i}")) for i in range(2)):
            assert time.monotonic() - t0 < DEADLINE_S, log_text(out, 0) + log_text(out, 1)
            assert all(p.poll() is None for p in procs), log_text(out, 0) + log_text(out, 1)
            time.sleep(0.1)
        dead = procs[victim]
        dead.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=30)
        took = time.monotonic() - t_kill
    finally:
        kill_all(procs)
    text = log_text(out, 1 - victim)
    assert took < 20, f"{took:.1f}s"
    named = f"learner host {victim} (pid {dead.pid} on "
    log = f"log: {os.path.join(out, f'host-{victim}.log')})"
    if victim == 1:
        assert code == 1, text[-3000:]
        assert "HostLost: " in text and f": lost {named}" in text and log in text, text[-3000:]
    else:
        assert code != 0, text[-3000:]
        assert "another task died" in text, text[-3000:]
        roster = next(line for line in text.splitlines() if line.startswith("learner hosts: "))
        assert named in roster and log in roster, roster


def test_hosts_config_errors_name_key_value_and_valid_choices():
    with pytest.raises(C.ConfigError, match=r"learner\.hosts: invalid value 0; must be > 0"):
        C.load(None, ["trainer.transport=ray", "learner.hosts=0"])
    with pytest.raises(
        C.ConfigError, match=r"learner\.hosts: invalid value 3; must divide the 4 devices.*1, 2, 4"
    ):
        C.load(None, ["trainer.transport=ray", "learner.hosts=3", "learner.mesh.fsdp=4"])
    cfg = C.load(None, ["trainer.transport=ray", "learner.hosts=2", "learner.mesh.fsdp=2"])
    assert cfg.learner.hosts == 2
