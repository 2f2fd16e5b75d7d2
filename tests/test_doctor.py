"""launch.doctor's report on this host and its exit codes; rl.accelerator's warning on simulated
device files, and launch.train printing it."""

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest

from launch import doctor, train
from rl import accelerator
from rl import config as C

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_doctor_reports_this_cpu(capsys):
    assert doctor.main(["--config", str(CONFIGS / "default.yaml")]) == 0
    out = capsys.readouterr().out
    assert "jax backend     cpu: 4 x cpu" in out  # conftest's 4 fake CPU devices
    assert "Pallas kernels  not on a CPU backend" in out
    assert "GPU test tier   skipped here" in out
    for name, dist in [("jax", "jax"), ("flax", "flax"), ("orbax", "orbax-checkpoint")]:
        assert f"{name:<16}{importlib.metadata.version(dist)}" in out
    for name in ("optax", "transformers", "vllm", "ray", "tensorboardX"):
        found = doctor.installed(name)  # CI has every one; a GPU machine may lack some
        assert f"{name:<16}{found[0] if found else 'missing: disables'}" in out
    assert "warning" not in out
    assert out.splitlines()[-1] == f"ok: {CONFIGS / 'default.yaml'} can run here"


@pytest.mark.parametrize(
    "config, package, setting",
    [("ray.yaml", "ray", "trainer.transport: ray"), ("vllm.yaml", "vllm", "rollout.engine: vllm")],
)
def test_doctor_config_needs_a_missing_package(monkeypatch, capsys, config, package, setting):
    installed = doctor.version
    gone = doctor.PACKAGES[package][0]  # vllm: both the GPU and the CPU distribution
    monkeypatch.setattr(doctor, "version", lambda dist: None if dist in gone else installed(dist))
    assert doctor.main(["--config", str(CONFIGS / config)]) == 1
    out = capsys.readouterr().out
    assert f"{package:<16}missing: disables" in out
    assert out.splitlines()[-1].startswith(f"cannot run here: {setting}")
    assert f"needs {package}, which is missing; install: python -m pip install -e" in out


def test_doctor_vllm_urls_need_no_local_vllm(monkeypatch, capsys):
    installed = doctor.version
    monkeypatch.setattr(doctor, "version", lambda d: None if d.startswith("vllm") else installed(d))
    urls = "rollout.vllm.urls=[http://gpu-0:8000]"
    assert doctor.main(["--config", str(CONFIGS / "vllm.yaml"), "--set", urls]) == 0
    out = capsys.readouterr().out
    assert "Pallas kernels  not used (rollout.engine: vllm)" in out


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--set", "trainer.no_such_key=1"], "trainer.no_such_key"),
        (["--config", "no/such/config.yaml"], "no/such/config.yaml"),
    ],
)
def test_doctor_bad_config_exits_2(capsys, argv, error):
    assert doctor.main(argv) == 2
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("config error:") and error in last


def host(tmp_path, *, nvidia=(), pci=()):
    """Simulated /dev and /sys/bus/pci/devices: device files, PCI (vendor, device) ids."""
    dev, bus = tmp_path / "dev", tmp_path / "pci"
    dev.mkdir()
    bus.mkdir()
    for name in nvidia:
        (dev / name).touch()
    for i, (vendor, device) in enumerate(pci):
        slot = bus / f"0000:00:{i:02x}.0"
        slot.mkdir()
        (slot / "vendor").write_text(vendor + "\n")
        (slot / "device").write_text(device + "\n")
    return {"dev": str(dev), "pci": str(bus)}


def test_warning_nvidia_gpu_on_cpu_jax(tmp_path):
    paths = host(tmp_path, nvidia=["nvidiactl", "nvidia0"])
    warning = accelerator.warning("cpu", {}, **paths)
    assert "an NVIDIA GPU" in warning and "this run uses the CPU" in warning
    assert 'python -m pip install -e ".[cuda13]"' in warning
    assert accelerator.warning("cpu", {"JAX_PLATFORMS": ""}, **paths) == warning


def test_no_warning_for_cpu_on_purpose_or_an_accelerator_backend(tmp_path):
    paths = host(tmp_path, nvidia=["nvidia0"])
    assert accelerator.warning("cpu", {"JAX_PLATFORMS": "cpu"}, **paths) is None
    assert accelerator.warning("gpu", {}, **paths) is None


def test_no_warning_without_accelerator_files(tmp_path):
    # nvidiactl alone is no GPU; a Google PCI device that is no TPU (gVNIC) neither
    paths = host(tmp_path, nvidia=["nvidiactl"], pci=[("0x1ae0", "0x0042"), ("0x8086", "0x0063")])
    assert accelerator.detect(**paths) is None
    assert accelerator.warning("cpu", {}, **paths) is None


def test_warning_tpu_on_cpu_jax(tmp_path):
    paths = host(tmp_path, pci=[("0x1ae0", "0x0042"), ("0x1ae0", "0x0063")])  # gVNIC, v5e
    assert accelerator.detect(**paths) == "tpu"
    warning = accelerator.warning("cpu", {}, **paths)
    assert "a TPU" in warning and 'python -m pip install -e ".[tpu]"' in warning
    assert accelerator.warning("tpu", {}, **paths) is None


def test_train_prints_the_warning_once(monkeypatch, capsys):
    class Trainer:  # stands in for rl.trainer's: the run ends at its construction
        def __init__(self, *args, **kwargs):
            raise C.ConfigError("stop here")

    monkeypatch.setitem(sys.modules, "rl.trainer", types.SimpleNamespace(Trainer=Trainer))
    monkeypatch.setattr(accelerator, "detect", lambda *args: "gpu")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert train.main(["--config", str(CONFIGS / "default.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count(accelerator.INSTALL["gpu"]) == 1
    assert err.splitlines()[-1] == "config error: stop here"
