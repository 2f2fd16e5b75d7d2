"""What several benchmarks share: device peaks, model presets, timing, and the RESULT line that
scripts read (`RESULT name=value ...`, printed last)."""

from __future__ import annotations

import re
import sys
import time

import jax

# Datasheet peaks: (dense bf16 FLOP/s, HBM bytes/s). The H200 is the H100 chip with more memory.
DEVICE_PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}
PRESETS = ("tiny", "qwen2_0p5b", "qwen2_1p5b")


def device_peaks(kind: str) -> tuple[float | None, float | None]:
    """(bf16 dense FLOP/s, HBM bytes/s) of an SXM H100/H200 from its device_kind; else None."""
    if re.search(r"\bH200\b", kind):
        return DEVICE_PEAKS["H200"]
    if re.search(r"\bH100\b", kind) and not re.search(r"PCIe|NVL", kind, re.IGNORECASE):
        return DEVICE_PEAKS["H100"]
    return None, None


def model_config(preset: str, **fields):
    """The ModelConfig of a preset name with runtime fields (dtype, remat, ...) set."""
    import models

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is unknown; use one of {PRESETS}")
    return getattr(models, preset)(**fields)


def add_model_arguments(parser, preset: str = "qwen2_0p5b") -> None:
    """--preset, --dtype, --attention and --seed (the learner and sampler benches)."""
    parser.add_argument("--preset", default=preset, choices=PRESETS)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--attention", choices=("cudnn", "xla"), help="default: cudnn on GPU")
    parser.add_argument("--seed", type=int, default=0)


def default_attention() -> str:
    """cudnn on a GPU, else xla."""
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


def reject_nonpositive(args, names: tuple[str, ...], zero_ok: tuple[str, ...] = ()) -> bool:
    """Prints an error for the first count in `names` below 1 (below 0 if in zero_ok)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < (0 if name in zero_ok else 1):
            print(f"--{name.replace('_', '-')}={value} must be positive", file=sys.stderr)
            return True
    return False


def timed(fn, *args):
    """(seconds, output) of fn(*args), waiting for its device work."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, out


def device_summary() -> tuple[str, float | None, float | None]:
    """Prints the first device; (its device_kind, datasheet FLOP/s, datasheet HBM bytes/s)."""
    dev = jax.devices()[0]
    kind = dev.device_kind
    flops, bw = device_peaks(kind) if dev.platform == "gpu" else (None, None)
    print(f"device: {kind} ({dev.platform}, {jax.device_count()} devices), jax {jax.__version__}")
    return kind, flops, bw


def peak_memory_gib() -> float | None:
    """This process's first device's peak memory in use (GiB), where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def fmt(x, digits: int = 6) -> str:
    """A number in `digits` significant digits; 'n/a' for None."""
    if x is None:
        return "n/a"
    return f"{x:.{digits}g}"


def print_result(values: dict, digits: int = 6) -> str:
    """Prints (and returns) the `RESULT name=value ...` line; None values read 'n/a'."""
    line = "RESULT " + " ".join(f"{k}={fmt(v, digits)}" for k, v in values.items())
    print(line, flush=True)
    return line
