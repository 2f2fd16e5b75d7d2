"""Start-up: JAX's persistent compilation cache for runs, this process's compile counters, and
the time a run takes to reach its first update.

The cache is on by default (trainer.compile_cache: auto) in a per-user directory, so a second
run of the same config, or the next run of a sweep, loads its programs instead of compiling
them. It is set through the environment too, so the rollout process, lockstep learner hosts
and Ray workers this process starts share it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from rl.config_rules import ConfigError

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_ENABLE = "JAX_ENABLE_COMPILATION_CACHE"
ENV_MIN_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
ENV_MAX_SIZE = "JAX_COMPILATION_CACHE_MAX_SIZE"
CACHE_ENV = (ENV_DIR, ENV_ENABLE, ENV_MIN_TIME, ENV_MAX_SIZE)  # what the run's processes inherit
MAX_SIZE_BYTES = 8 << 30  # least recently used entries go beyond this (unless the env says)

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


# XLA's GEMMs on a GPU without autotuning: cuBLAS at its heuristics' choice. XLA's default
# compiles Triton GEMM candidates for each new matmul shape and times them on the device, which
# made most of a small model's compile time (docs/benchmarks.md#start-up-on-one-h100).
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


def gemm_options(autotune: bool, platform: str, base: dict | None = None) -> dict | None:
    """compiler_options of a program on `platform` (trainer.gemm_autotune): `base`, plus
    cuBLAS GEMMs without autotuning on a GPU unless `autotune`. None where nothing is set."""
    out = dict(base or {})
    if platform == "gpu" and not autotune:
        out.update(CUBLAS_GEMMS)
    return out or None


def default_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/tandem/jax (~/.cache/...)."""
    if os.environ.get(ENV_DIR):  # absolute: a relative one would move with the working dir
        return os.path.abspath(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tandem", "jax")


def cache_dir(setting: str) -> str | None:
    """The directory trainer.compile_cache names: auto (default_cache_dir), off (None), a path."""
    if setting == "off":
        return None
    if setting == "auto":
        return default_cache_dir()
    return os.path.abspath(os.path.expanduser(setting))


def enable_cache(setting: str) -> str | None:
    """Points this process's JAX, and the processes it starts, at the cache (or turns it off).
    Every program is cached, however fast it compiled: a start compiles dozens of small ones.
    Returns the directory, or None when off. A process that compiled under another setting
    (tests, notebooks running several configs) switches from its next compilation on."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = cache_dir(setting)
    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    if path is None:
        os.environ[ENV_ENABLE] = "false"
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            if setting == "auto":  # a read-only home: the run goes on, compiling everything
                print(f"[tandem] compile cache off: cannot create {path} ({e})", file=sys.stderr)
                return enable_cache("off")
            raise ConfigError(
                f"trainer.compile_cache: invalid value {setting!r}: cannot create {path} ({e}); "
                "must be auto, off or a directory this user can write"
            ) from e
        os.environ.update({ENV_DIR: path, ENV_ENABLE: "true"})
        os.environ.setdefault(ENV_MIN_TIME, "0")
        os.environ.setdefault(ENV_MAX_SIZE, str(MAX_SIZE_BYTES))
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", float(os.environ[ENV_MIN_TIME])
        )
        jax.config.update("jax_compilation_cache_max_size", int(os.environ[ENV_MAX_SIZE]))
    if (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir) != before:
        compilation_cache.reset_cache()  # JAX opens its cache once: reopen with this setting
    return path


def describe_cache(path: str | None) -> str:
    """One line for the log: where the cache is and what it holds."""
    if path is None:
        return "compile cache: off (trainer.compile_cache)"
    n = size = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.is_file():
                    n += 1
                    size += e.stat().st_size
    except OSError:
        pass
    return f"compile cache: {path} ({n} entries, {size / 2**20:.0f} MiB)"


class CompileCounter:
    """This process's JAX compilations since it started counting (process-wide listeners,
    registered once): traces, lowerings and backend compilations with their seconds, and the
    persistent cache's requests and hits (a miss compiles and writes the entry)."""

    _lock = threading.Lock()
    _totals: dict[str, float] = {}
    _programs: dict[str, list[float]] = {}  # backend compilations by program: [count, seconds]
    _registered = False

    @classmethod
    def _register(cls) -> None:
        from jax import monitoring

        with cls._lock:
            if cls._registered:
                return
            cls._registered = True

        def on_duration(event: str, duration: float, fun_name: str = "?", **_) -> None:
            if event in (_TRACE, _LOWER, _COMPILE, _SAVED):
                with cls._lock:
                    cls._totals[event] = cls._totals.get(event, 0.0) + duration
                    cls._totals[event + "#n"] = cls._totals.get(event + "#n", 0.0) + 1
                    if event == _COMPILE:
                        n_s = cls._programs.setdefault(str(fun_name), [0.0, 0.0])
                        n_s[0] += 1
                        n_s[1] += duration

        def on_event(event: str, **_) -> None:
            if event in (_REQUESTS, _HITS):
                with cls._lock:
                    cls._totals[event] = cls._totals.get(event, 0.0) + 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    def __init__(self):
        self._register()
        self._start = self.totals()
        with self._lock:
            self._start_programs = {k: tuple(v) for k, v in self._programs.items()}

    @classmethod
    def totals(cls) -> dict[str, float]:
        """Counts and seconds since this process registered the listeners."""
        with cls._lock:
            t = dict(cls._totals)
        requests, hits = t.get(_REQUESTS, 0.0), t.get(_HITS, 0.0)
        return {
            "compile/traces": t.get(_TRACE + "#n", 0.0),
            "compile/trace_s": t.get(_TRACE, 0.0),
            "compile/lower_s": t.get(_LOWER, 0.0),
            "compile/programs": t.get(_COMPILE + "#n", 0.0),
            "compile/compile_s": t.get(_COMPILE, 0.0),
            "compile/cache_hits": hits,
            "compile/cache_misses": requests - hits,
            "compile/cache_saved_s": t.get(_SAVED, 0.0),
        }

    def programs_since_start(self) -> dict[str, list[float]]:
        """Backend compilations since this counter was made, by program name: [count, seconds]
        (a cache hit's load counts as its compilation), the slowest first."""
        with self._lock:
            now = {k: tuple(v) for k, v in self._programs.items()}
        out = {}
        for name, (n, sec) in now.items():
            n0, s0 = self._start_programs.get(name, (0.0, 0.0))
            if n > n0:
                out[name] = [n - n0, round(sec - s0, 4)]
        return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))

    def since_start(self) -> dict[str, float]:
        """Counts and seconds since this counter was made. compile/seconds: tracing, lowering
        and compiling together (a cache hit's load is in compile_s)."""
        now = self.totals()
        out = {k: v - self._start.get(k, 0.0) for k, v in now.items()}
        out["compile/seconds"] = out["compile/trace_s"] + out["compile/lower_s"]
        out["compile/seconds"] += out["compile/compile_s"]
        return out


def process_age_s() -> float:
    """Seconds since this process was created (the interpreter's start and imports included)."""
    import psutil

    return time.time() - psutil.Process(os.getpid()).create_time()


class StartupClock:
    """A run's start: turns the compilation cache on (or off) as `setting` says, then times the
    phases up to the first update and counts the compilations on the way."""

    def __init__(self, setting: str, progress: bool = True):
        self.cache = enable_cache(setting)  # before anything compiles
        self.compiles = CompileCounter()
        self.progress = progress
        self.phases: dict[str, float] = {}
        self._first_done = False
        self._last = process_age_s()
        if progress:
            print(f"[tandem] {describe_cache(self.cache)}", file=sys.stderr)

    def mark(self, name: str) -> None:
        """Phase `name` ends now: its seconds since the previous phase ended (the first phase:
        since the process began)."""
        now = process_age_s()
        self.phases[name] = now - (self._last if self.phases else 0.0)
        self._last = now

    def row(self) -> dict[str, float]:
        """The phases so far and this process's compilations, for a metrics row."""
        return {**self.phases, **self.compiles.since_start()}

    def first_update(self, engine_stats: dict, run_dir: str | None = None) -> dict[str, float]:
        """At this process's first update (the first call): the time since the process began
        and the compilations until then, here and in a rollout process of its own (its stats'
        "compile"), as metrics and one progress line; with run_dir, each program's compile
        count and seconds in run_dir/compile.json. Later calls: {}."""
        if self._first_done:
            return {}
        self._first_done = True
        out = {"startup/first_update_s": process_age_s(), **self.compiles.since_start()}
        child = engine_stats.get("compile") or {}
        out.update({f"rollout_{k}": v for k, v in child.items()})
        programs = self.compiles.programs_since_start()
        child_programs = engine_stats.get("compile_programs") or {}
        if run_dir is not None:
            path = os.path.join(run_dir, "compile.json")
            write_compile_report(path, {**self.phases, **out}, programs, child_programs)
        if self.progress:
            line = summary_line(out["startup/first_update_s"], out, child)
            print(line + slowest_programs(programs, child_programs), file=sys.stderr)
        return out


def write_compile_report(path: str, totals: dict, programs: dict, child_programs: dict) -> None:
    """The compilations up to the first update, by process and program, as JSON."""
    import json

    report = {
        "first_update_s": totals["startup/first_update_s"],
        "phases": {k: v for k, v in totals.items() if k.startswith("startup/")},
        "this_process": {"totals": _unprefixed(totals, "compile/"), "programs": programs},
        "rollout_process": {
            "totals": _unprefixed(totals, "rollout_compile/"),
            "programs": child_programs,
        },
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def _unprefixed(d: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)}


def slowest_programs(programs: dict, child_programs: dict, k: int = 3) -> str:
    """ "; slowest: NAME S s (xN), ..." over both processes, for the first update's line."""
    both = [(n, c, s) for n, (c, s) in programs.items()]
    both += [(f"{n} (rollout)", c, s) for n, (c, s) in child_programs.items()]
    both.sort(key=lambda t: -t[2])
    if not both:
        return ""
    parts = [f"{n} {s:.1f} s" + (f" (x{c:.0f})" if c > 1 else "") for n, c, s in both[:k]]
    return "; slowest: " + ", ".join(parts)


def summary_line(first_update_s: float, compiled: dict, child: dict | None = None) -> str:
    """The progress line of the first update: time since the process started, and compiles
    (their seconds summed: the sampler's warm-up compiles several at once)."""
    line = (
        f"[tandem] first update {first_update_s:.1f} s after start; compile time "
        f"{compiled['compile/seconds']:.1f} s here ({compiled['compile/programs']:.0f} programs, "
        f"cache {compiled['compile/cache_hits']:.0f} hits / "
        f"{compiled['compile/cache_misses']:.0f} misses)"
    )
    if child:
        line += (
            f", {child['compile/seconds']:.1f} s in the rollout process "
            f"({child['compile/programs']:.0f} programs, cache "
            f"{child['compile/cache_hits']:.0f} hits / {child['compile/cache_misses']:.0f} misses)"
        )
    return line
