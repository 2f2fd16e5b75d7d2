"""Backend-aware placement: one config, the rollout placed by the backend and device count, and
every backend-dependent misconfiguration refused before any work with the key, the backend and
what is valid there."""

import os
import subprocess
import sys
import time

import jax
import pytest

from rl import config as C
from rl.placement import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(*overrides):
    return C.load(None, list(overrides))


def test_auto_follows_backend_and_device_count():
    devs = jax.devices()  # 4 fake CPU devices; backend= pretends they are GPUs
    assert resolve(_cfg(), backend="cpu", devices=devs).kind == "process"
    assert resolve(_cfg(), backend="gpu", devices=devs[:1]).kind == "in_process"
    two = resolve(_cfg(), backend="gpu", devices=devs[:2])
    assert two.kind == "split"
    assert two.split.rollout == (devs[0],) and two.split.learner == (devs[1],)
    four = resolve(_cfg(), backend="gpu", devices=devs)
    assert four.split.learner == tuple(devs[1:])
    assert four.config.learner.mesh.data == 3  # every learner device, data parallel
    assert four.config.trainer.rollout_devices == [0]  # what the run directory records
    pinned = resolve(_cfg("trainer.pin_cores=true"), backend="cpu", devices=devs)
    assert pinned.kind == "process" and pinned.cores.rollout == (0,)
    # vLLM hosts or Ray workers are the rollout: the evaluator runs beside the learner
    assert resolve(_cfg("rollout.engine=vllm"), backend="cpu", devices=devs).kind == "in_process"


@pytest.mark.parametrize(
    "overrides,backend,n,words",
    [
        (
            ["trainer.placement=process"],
            "gpu",
            1,
            ["trainer.placement", "'process'", "CPU", "'gpu'"],
        ),
        (["trainer.pin_cores=true"], "gpu", 2, ["trainer.pin_cores", "'gpu'", "Valid here: false"]),
        (["trainer.placement=split"], "gpu", 1, ["trainer.placement", "'split'", "2 devices"]),
        (["trainer.placement=split"], "cpu", 1, ["Valid here: auto, in_process, process"]),
        (["trainer.rollout_devices=[5]"], "gpu", 2, ["trainer.rollout_devices", "[5]", "0..1"]),
    ],
)
def test_backend_dependent_errors_name_key_backend_and_valid(overrides, backend, n, words):
    with pytest.raises(C.ConfigError) as err:
        resolve(_cfg(*overrides), backend=backend, devices=jax.devices()[:n])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_misconfigured_run_fails_within_seconds_before_any_work(tmp_path):
    """`python -m launch.train` on a host that cannot run the config: exit 2 with the reason as
    the last line, within 5 s, and nothing written but the run directory's absence."""
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1"
    )
    cmd = [sys.executable, "-m", "launch.train", "--set", "trainer.placement=split"]
    cmd += ["--set", f"run_root={tmp_path}", "--set", "name=bad"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: trainer.placement: 'split' needs at least 2 devices")
    assert "'cpu' backend with 1 device(s)" in last
    assert took < 5.0, f"failed after {took:.1f} s"
    assert not os.path.exists(tmp_path / "bad")  # before any work: not even the run directory
