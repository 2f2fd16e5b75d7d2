"""What several benchmarks share: device peaks, model presets, timing, and the RESULT line that
scripts read (`RESULT name=value ...`, printed last)."""

from __future__ import annotations

import collections
import re
import sys
import time

import jax

# Datasheet peaks: (dense bf16 FLOP/s, HBM bytes/s). The H200 is the H100 chip with more memory.
DEVICE_PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}
PRESETS = ("tiny", "qwen2_0p5b", "qwen2_1p5b", "llama3_8b")


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


_GRID = re.compile(r"grid:(\d+),(\d+),(\d+)")  # in the trace's kernel_details of a launch
_KERNEL_KINDS = (  # (kind, substrings of a GPU kernel's name), first match wins
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("attention", ("fmha", "flash", "sdpa")),
    ("copy", ("memcpy", "memset", "copy", "dynamic")),
    ("fusion", ("fusion",)),
)


def gpu_kernel_times(run, wait, calls: int = 1, ctas: dict | None = None) -> dict:
    """{kernel name: [launches, total ms]} of the GPU kernels that `calls` calls of run() start,
    from a jax.profiler trace (wait() returns what to block on afterwards); empty off a GPU.
    ctas, if given, gets each kernel's grid size in CTAs where the trace records it."""
    import glob
    import tempfile

    from jax._src.lib import _profile_data  # the trace reader JAX's own profiler tests use

    kernels: dict = collections.defaultdict(lambda: [0, 0.0])
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                run()
            jax.block_until_ready(wait())
        data = _profile_data.ProfileData.from_file(
            glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        )
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "stream" in line.name.lower():
                    for e in line.events:
                        kernels[e.name][0] += 1
                        kernels[e.name][1] += e.duration_ns / 1e6
                        if ctas is not None and e.name not in ctas:  # one launch says it
                            details = dict(e.stats).get("kernel_details")
                            grid = _GRID.search(details) if isinstance(details, str) else None
                            if grid:
                                x, y, z = (int(g) for g in grid.groups())
                                ctas[e.name] = x * y * z
    return dict(kernels)


def kernel_profile(step, state, steps: int = 2, per: int = 1, unit: str = "step") -> None:
    """Device kernel time per `unit` (`steps` calls of step(), each `per` units) by kind
    (matmul, attention, elementwise fusion, copy) and the slowest kernels, from a jax.profiler
    trace; printed."""
    ctas: dict = {}
    kernels = {
        name: [n, ms / (steps * per)]
        for name, (n, ms) in gpu_kernel_times(step, state, steps, ctas).items()
    }
    if not kernels:
        print("profile: no GPU kernels in the trace")
        return
    kinds: dict = collections.defaultdict(float)
    for name, (_, ms) in kernels.items():
        low = name.lower()
        kind = next((k for k, subs in _KERNEL_KINDS if any(x in low for x in subs)), "other")
        kinds[kind] += ms
    total = sum(kinds.values())
    count = sum(n for n, _ in kernels.values()) / (steps * per)
    print(
        f"profile: {count:.0f} kernels, kernel time {total:.3f} ms per {unit}; "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    )
    for name, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]:
        grid = f"  [{ctas[name]} CTAs]" if name in ctas else ""  # waves: CTAs over the SMs
        print(f"  {ms:8.3f} ms x{n / (steps * per):7.1f}  {name[:96]}{grid}")
