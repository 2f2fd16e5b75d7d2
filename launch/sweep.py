"""python -m launch.sweep --config configs/sweeps/NAME.yaml [--parallel N] [--out DIR] [--ray]

Runs a grid (or list) of config overrides as separate `launch.train` processes and tabulates
their metrics. A sweep file:

    base: configs/default.yaml          # run config every run starts from
    set: {trainer.mode: async}          # overrides common to every run
    grid:                               # one run per combination (or `runs:`, a list of
      trainer.max_staleness: [0, 1, 2]  #   override mappings, each with an optional `name`)
      algorithm.loss: [ppo_clip, decoupled_ppo]
    seeds: [0, 1]                       # every run repeated per seed (empty: the config's)
    metrics: [eval/accuracy, reward/mean]

A study of several settings (each its own base and overrides) is a file of parts, other sweep
files run one after another, each into its own output directory:

    parts: [setting-a.yaml, setting-b.yaml]

Runs go one at a time by default, `--parallel N` at once as local processes, or with `--ray` as
Ray tasks (each reserving `--ray-cpus` CPUs, at most `--parallel` at once) on a local cluster or
the one `--ray-address` / RAY_ADDRESS names; on a multi-node cluster OUT must be on a filesystem
every node shares, and this checkout importable at the same path there.

Each run trains in OUT/<run>/ with its log in OUT/<run>/train.log. A finished run leaves a DONE
marker holding its summary and is skipped when the sweep is invoked again; a failed run is
recorded (status, last log lines) and the sweep goes on. OUT/results.csv and OUT/results.md hold
one row per run: overrides, seed, status, final and best (max) of every metric, wall-clock
seconds and mean tokens/s.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from typing import Any, Literal, TextIO

import yaml

from rl import config as C
from rl.config import F

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DONE = "DONE"
FAILED = "FAILED"
LOG = "train.log"
TAIL_LINES = 8


@dataclasses.dataclass
class SweepFile:
    base: str = F("configs/default.yaml", "run config of every run (path from cwd or the file)")
    name: str = F("", "sweep name; runs are named <name>/<run>; empty = the file's stem")
    set: dict[str, Any] = F({}, "overrides common to every run (key.path: value)")
    grid: dict[str, list[Any]] = F({}, "key.path: [values]; one run per combination")
    runs: list[dict[str, Any]] = F([], "explicit runs: override mappings, optional `name`")
    seeds: list[int] = F([], "repeat every run with each seed; empty = the config's seed")
    metrics: list[str] = F(["eval/accuracy", "reward/mean"], "metrics to tabulate")
    order: Literal["run", "seed"] = F(
        "run",
        "run: each run's seeds one after another; seed: every run's first seed, then every "
        "run's second... (runs compared on wall clock then share the machine's drift)",
    )
    parts: list[str] = F(
        [],
        "other sweep files (paths from cwd or this file's directory), run one after another, "
        "each into <run_root>/<its name>/ (OUT/<its name>/ with --out); a file of parts has no "
        "other keys",
    )


@dataclasses.dataclass
class RunSpec:
    """One run of a sweep: its name and the overrides that make it."""

    name: str
    overrides: dict[str, Any]  # the run's own overrides (flattened key.path -> value)
    seed: int | None  # the sweep's seed for this run; None = the config's


@dataclasses.dataclass
class Sweep:
    """A validated sweep file with its runs expanded."""

    path: str
    name: str
    base: str  # absolute path of the base run config
    common: dict[str, Any]  # flattened `set:` overrides
    runs: list[RunSpec]
    metrics: list[str]
    base_seed: int  # the seed of base + set


# ---------------------------------------------------------------------------------------------
# Loading and expansion


def _normalize(value: Any) -> Any:
    """YAML 1.1 reads 1e-3 as a string; such strings become floats, as with --set."""
    if isinstance(value, str) and C.FLOAT_RE.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return value


def _flatten(data: dict, where: str, prefix: str = "") -> dict[str, Any]:
    """Nested override mappings -> {key.path: value} (an empty mapping stays a value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            items = _flatten(value, where, path)
        else:
            items = {path: _normalize(value)}
        for k, v in items.items():
            if k in out:
                raise C.ConfigError(f"{where}: key {k!r} given twice")
            out[k] = v
    return out


def set_arg(key: str, value: Any) -> str:
    """`key=text` for `launch.train --set` such that the text parses back to `value`."""
    text = value if isinstance(value, str) else json.dumps(value)
    if C.parse_scalar(text) != value:
        text = json.dumps(value)  # quoted: e.g. the string "true" or "1"
    parsed = C.parse_scalar(text)
    if parsed != value or type(parsed) is not type(value):
        raise C.ConfigError(f"{key}: value {value!r} cannot be passed as --set {key}={text}")
    return f"{key}={text}"


def _label(value: Any) -> str:
    """A value as a short, path-safe part of a run name."""
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(",", ""))
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "empty"


def _auto_name(overrides: dict[str, Any], varied: list[str]) -> str:
    """`leaf-value` parts joined by `_`; a key's full path where two leaves would clash."""
    leaves = [k.rsplit(".", 1)[-1] for k in varied]
    parts = []
    for key, value in overrides.items():
        leaf = key.rsplit(".", 1)[-1]
        label = leaf if leaves.count(leaf) == 1 else key
        parts.append(f"{label}-{_label(value)}")
    return "_".join(parts) or "base"


def _resolve_base(base: str, sweep_path: str) -> str:
    """The base config path: as given, else relative to the sweep file's directory."""
    candidates = (
        [base]
        if os.path.isabs(base)
        else [
            os.path.abspath(base),
            os.path.join(os.path.dirname(os.path.abspath(sweep_path)), base),
        ]
    )
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise C.ConfigError(f"base: config file {base!r} not found (looked at {candidates})")


def from_dict(data: Any, path: str = "<sweep>") -> Sweep:
    """Validates a sweep mapping and expands its runs (raises ConfigError naming the key)."""
    try:
        return _from_dict(data, path)
    except C.ConfigError as e:
        raise C.ConfigError(f"{path}: {e}") from None


def _from_dict(data: Any, path: str) -> Sweep:
    if not isinstance(data, dict):
        raise C.ConfigError(f"expected a mapping of sweep keys, got {data!r}")
    spec: SweepFile = C.build_section(SweepFile, data)
    err = C.ConfigError

    if spec.grid and spec.runs:
        raise err("grid and runs are exclusive; give one of them")
    for key, values in spec.grid.items():
        if not values:
            raise err(f"grid.{key}: empty list of values")
    if len(set(spec.seeds)) != len(spec.seeds):
        raise err(f"seeds: duplicate seeds in {spec.seeds}")
    if not all(isinstance(m, str) and m for m in spec.metrics):
        raise err(f"metrics: expected metric names, got {spec.metrics!r}")
    name = spec.name or os.path.splitext(os.path.basename(path))[0]
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
        raise err(f"name: invalid value {name!r}; use letters, digits and . _ + -")
    base = _resolve_base(spec.base, path)
    common = _flatten(spec.set, "set")
    reserved = {"name"} | ({"seed"} if spec.seeds else set())
    for where, keys in [("set", common), ("grid", _flatten(spec.grid, "grid"))]:
        for key in keys:
            if key in reserved:
                raise err(f"{where}.{key}: set by the sweep itself (run names, seeds:)")
    try:
        base_cfg = C.load(base, [set_arg(k, v) for k, v in common.items()])
    except C.ConfigError as e:
        raise err(f"base + set do not make a valid config: {e}") from None

    bodies: list[tuple[str | None, dict[str, Any]]] = []
    if spec.grid:
        keys = list(spec.grid)
        for combo in itertools.product(*(_normalize(spec.grid[k]) for k in keys)):
            bodies.append((None, dict(zip(keys, combo))))
    elif spec.runs:
        for i, run in enumerate(spec.runs):
            run = dict(run)
            run_name = run.pop("name", None)
            if run_name is not None and not (
                isinstance(run_name, str) and re.fullmatch(r"[A-Za-z0-9._+-]+", run_name)
            ):
                raise err(f"runs[{i}].name: invalid value {run_name!r}; letters, digits, . _ + -")
            flat = _flatten(run, f"runs[{i}]")
            if "seed" in flat and spec.seeds:
                raise err(f"runs[{i}].seed: set by the sweep's seeds:")
            bodies.append((run_name, flat))
    else:
        bodies.append((None, {}))
    varied = list(dict.fromkeys(k for _, body in bodies for k in body))
    runs = []
    for run_name, body in bodies:
        for k, v in body.items():
            set_arg(k, v)  # fails early on a value that cannot be passed
        stem = run_name or _auto_name(body, varied)
        for seed in spec.seeds or [None]:
            full = stem if seed is None else f"{stem}_seed-{seed}"
            runs.append(RunSpec(full, body, seed))
    if spec.order == "seed" and spec.seeds:
        runs.sort(key=lambda r: spec.seeds.index(r.seed))  # stable: the runs' order per seed
    names = [r.name for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise err(f"run names are not unique: {dupes}; give runs distinct `name`s")
    return Sweep(path, name, base, common, runs, list(spec.metrics), base_cfg.seed)


def _read(path: str) -> Any:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise C.ConfigError(f"{path}: sweep file not found") from None
    except yaml.YAMLError as e:
        raise C.ConfigError(f"{path}: not valid YAML: {e}") from None
    return data if data is not None else {}


def _has_parts(data: Any) -> bool:
    return isinstance(data, dict) and "parts" in data


def load(path: str) -> Sweep:
    """Loads and validates a sweep YAML file (one without parts)."""
    data = _read(path)
    if _has_parts(data):
        raise C.ConfigError(f"{path}: a file of parts; load it with load_all")
    return from_dict(data, path)


def load_all(path: str) -> tuple[list[Sweep], bool]:
    """The sweeps a file stands for, validated before any runs, and whether they are its parts
    (else the one sweep is the file itself)."""
    data = _read(path)
    if not _has_parts(data):
        return [from_dict(data, path)], False
    extra = sorted(set(data) - {"parts"})
    if extra:
        raise C.ConfigError(f"{path}: {extra[0]}: a file of parts has no other keys")
    parts = data["parts"]
    if not (isinstance(parts, list) and parts and all(isinstance(p, str) for p in parts)):
        raise C.ConfigError(f"{path}: parts: expected a list of sweep files, got {parts!r}")
    sweeps = []
    for i, part in enumerate(parts):
        try:
            part_path = _resolve_base(part, path)
        except C.ConfigError:
            raise C.ConfigError(f"{path}: parts[{i}]: sweep file {part!r} not found") from None
        sub = _read(part_path)
        if _has_parts(sub):
            raise C.ConfigError(f"{path}: parts[{i}]: {part!r} has parts itself (one level only)")
        sweeps.append(from_dict(sub, part_path))
    names = [s.name for s in sweeps]
    if len(set(names)) != len(names):
        raise C.ConfigError(
            f"{path}: parts: two parts share a name ({names}): their runs would mix"
        )
    return sweeps, True


def command(sweep: Sweep, run: RunSpec, run_dir: str, *, resume: bool = False) -> list[str]:
    """The `launch.train` command line of one run."""
    cmd = [sys.executable, "-m", "launch.train", "--config", sweep.base]
    items = {**sweep.common, **run.overrides}
    if run.seed is not None:
        items["seed"] = run.seed
    items["name"] = f"{sweep.name}/{run.name}"
    for key, value in items.items():
        cmd += ["--set", set_arg(key, value)]
    cmd += ["--run-dir", run_dir]
    if resume:
        cmd.append("--resume")
    return cmd


# ---------------------------------------------------------------------------------------------
# Running


def _tail(path: str, n: int = TAIL_LINES) -> list[str]:
    """The last n non-empty lines of a text file."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except FileNotFoundError:
        return []
    return lines[-n:]


def _summary_from_log(path: str) -> dict:
    """The JSON summary launch.train prints last (an empty dict if there is none)."""
    for line in reversed(_tail(path, 50)):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)


def _has_checkpoint(run_dir: str) -> bool:
    ckpt = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


def _stop(proc, grace_s: float = 20.0) -> None:
    """Terminates proc (a Popen or a _RayProc), then kills it if it outlives grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _run_logged(cmd: list[str], log_path: str, env: dict) -> int:
    """Runs cmd with its output appended to log_path (in a Ray task: on that node); its exit code.

    Cancelled (KeyboardInterrupt from ray.cancel), it stops the trainer before returning.
    """
    with open(log_path, "a") as log:
        log.write(f"[ray task: pid {os.getpid()} on {os.uname().nodename}]\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait()
        except BaseException:
            _stop(proc)
            raise


class _RayProc:
    """A run as a Ray task, with the part of Popen's interface the sweep uses."""

    def __init__(self, cmd: list[str], log_path: str, env: dict, num_cpus: float):
        import ray

        self._ray = ray
        task = ray.remote(num_cpus=num_cpus, max_retries=0)(_run_logged)
        self.ref = task.remote(cmd, log_path, env)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self._ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self.returncode = int(self._ray.get(self.ref))
                except Exception:  # noqa: BLE001 - the task or its worker died: a failed run
                    self.returncode = 1
        return self.returncode

    def terminate(self) -> None:
        self._ray.cancel(self.ref)  # KeyboardInterrupt in the task: it stops the trainer

    def kill(self) -> None:
        self._ray.cancel(self.ref, force=True)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("ray task", timeout)
            time.sleep(0.1)
        return self.returncode


class _Running:
    def __init__(
        self, run: RunSpec, run_dir: str, cmd: list[str], env: dict, ray_cpus: float | None = None
    ):
        self.run, self.run_dir, self.cmd = run, run_dir, cmd
        self.log_path = os.path.join(run_dir, LOG)
        self.log = open(self.log_path, "a")  # noqa: SIM115 - closed in finish(); keeps earlier tries
        self.log.write("$ " + shlex.join(cmd) + "\n")
        self.log.flush()
        self.t0 = time.perf_counter()
        if ray_cpus is None:
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        else:
            self.proc = _RayProc(cmd, self.log_path, env, ray_cpus)

    def finish(self, rc: int) -> dict:
        self.log.close()
        wall = time.perf_counter() - self.t0
        record = {"run": self.run.name, "returncode": rc, "wall_s": wall, "command": self.cmd}
        for marker in (DONE, FAILED):
            if os.path.exists(os.path.join(self.run_dir, marker)):
                os.remove(os.path.join(self.run_dir, marker))
        if rc == 0:
            record.update(status="ok", summary=_summary_from_log(self.log_path))
            _write_json(os.path.join(self.run_dir, DONE), record)
        else:
            record.update(status="failed", tail=_tail(self.log_path))
            _write_json(os.path.join(self.run_dir, FAILED), record)
        return record

    def stop(self) -> None:
        if self.proc.poll() is None:
            _stop(self.proc)
        self.log.close()


def run_sweep(
    sweep: Sweep,
    out: str,
    *,
    parallel: int = 1,
    stream: TextIO | None = None,
    ray_cpus: float | None = None,
) -> list[dict]:
    """Runs every run not yet DONE (`parallel` at a time, as Ray tasks of `ray_cpus` CPUs if
    given, on the cluster ray is connected to); writes and returns the results."""
    if parallel < 1:
        raise ValueError(f"parallel={parallel}: must be >= 1")
    if ray_cpus is not None and ray_cpus <= 0:
        raise ValueError(f"ray_cpus={ray_cpus}: must be > 0")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")

    def say(msg: str) -> None:
        print(f"[sweep] {msg}", file=stream or sys.stdout, flush=True)

    records: dict[str, dict] = {}
    pending: deque[RunSpec] = deque()
    for run in sweep.runs:
        done = os.path.join(out, run.name, DONE)
        if os.path.exists(done):
            with open(done) as f:
                records[run.name] = {**json.load(f), "skipped": True}
            say(f"skip {run.name} (DONE)")
        else:
            pending.append(run)
    skipped = len(records)
    total = len(sweep.runs)
    running: list[_Running] = []
    started = 0
    try:
        while pending or running:
            while pending and len(running) < parallel:
                run = pending.popleft()
                run_dir = os.path.abspath(os.path.join(out, run.name))
                os.makedirs(run_dir, exist_ok=True)
                resume = _has_checkpoint(run_dir)
                cmd = command(sweep, run, run_dir, resume=resume)
                running.append(_Running(run, run_dir, cmd, env, ray_cpus))
                started += 1
                say(
                    f"start {run.name} ({started}/{total - skipped}){' resuming' if resume else ''}"
                )
            for r in list(running):
                rc = r.proc.poll()
                if rc is None:
                    continue
                running.remove(r)
                rec = records[r.run.name] = r.finish(rc)
                if rc == 0:
                    say(f"done {r.run.name} in {rec['wall_s']:.1f}s")
                else:
                    last = rec["tail"][-1] if rec["tail"] else ""
                    say(f"FAILED {r.run.name} (exit {rc}): {last} [log: {r.log_path}]")
            if running:
                time.sleep(0.2)
    finally:
        for r in running:  # interrupted: no orphan trainers
            r.stop()
    rows = [
        result_row(sweep, run, os.path.join(out, run.name), records[run.name]) for run in sweep.runs
    ]
    write_results(sweep, rows, out)
    failed = sum(r["status"] != "ok" for r in rows)
    say(f"{total} runs: ran {total - skipped}, skipped {skipped}, failed {failed}")
    return rows


# ---------------------------------------------------------------------------------------------
# Results


def metric_stats(run_dir: str, metrics: list[str]) -> dict[str, float | None]:
    """Final and best (max) of each metric and mean tokens/s from a run's metrics.jsonl."""
    from rl.metrics import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.exists(path) else []
    out: dict[str, float | None] = {}

    def series(name: str) -> list[float]:
        vals = [r.get(name) for r in rows]
        return [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]

    for m in metrics:
        vals = series(m)
        out[f"{m}:final"] = vals[-1] if vals else None
        out[f"{m}:best"] = max(vals) if vals else None
    tps = series("throughput/tokens_per_s")
    out["tokens_per_s"] = sum(tps) / len(tps) if tps else None
    return out


def result_row(sweep: Sweep, run: RunSpec, run_dir: str, record: dict) -> dict:
    """One results row: run, seed, overrides, status, metrics, wall seconds, tokens/s."""
    varied = list(dict.fromkeys(k for r in sweep.runs for k in r.overrides))
    row: dict[str, Any] = {"run": run.name}
    row["seed"] = run.seed if run.seed is not None else run.overrides.get("seed", sweep.base_seed)
    for key in varied:
        row[key] = run.overrides.get(key)
    row["status"] = record["status"]
    stats = metric_stats(run_dir, sweep.metrics)
    for m in sweep.metrics:
        row[f"{m}:final"] = stats[f"{m}:final"]
        row[f"{m}:best"] = stats[f"{m}:best"]
    row["wall_s"] = record.get("wall_s")
    row["tokens_per_s"] = stats["tokens_per_s"]
    row["error"] = "\n".join(record.get("tail", [])) if record["status"] != "ok" else ""
    return row


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table (the error column only when some run failed)."""
    if not rows:
        return "(no runs)\n"
    cols = [c for c in rows[0] if c != "error" or any(r["error"] for r in rows)]

    def cell(col: str, value: Any) -> str:
        if col == "error":
            value = value.splitlines()[-1][:160] if value else ""
        elif col == "wall_s" and value is not None:
            value = f"{value:.1f}"
        elif col == "tokens_per_s" and value is not None:
            value = f"{value:.0f}"
        return _fmt(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(c, r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_results(sweep: Sweep, rows: list[dict], out: str) -> None:
    """Writes OUT/results.csv and OUT/results.md."""
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else _csv_value(v)) for k, v in r.items()})
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        f.write(buf.getvalue())
    header = f"# Sweep {sweep.name}\n\nfrom `{sweep.path}`, base `{sweep.base}`\n\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(header + markdown_table(rows))


def _csv_value(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) else v


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, runs the sweep, prints the results table."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="sweep YAML file")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--out", help="output directory (default: <run_root>/<sweep name>)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--ray", action="store_true", help="run each run as a Ray task")
    parser.add_argument(
        "--ray-address",
        default="",
        help="with --ray: cluster to join (default: RAY_ADDRESS, else a local one)",
    )
    parser.add_argument(
        "--ray-cpus", type=float, default=1.0, help="with --ray: CPUs each run reserves (default 1)"
    )
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: must be >= 1")
    if args.ray_cpus <= 0:
        parser.error(f"--ray-cpus {args.ray_cpus}: must be > 0")
    try:
        sweeps, parts = load_all(args.config)
        outs = []
        for sweep in sweeps:
            if args.out:
                outs.append(os.path.join(args.out, sweep.name) if parts else args.out)
            else:
                cfg = C.load(sweep.base, [set_arg(k, v) for k, v in sweep.common.items()])
                outs.append(os.path.join(cfg.run_root, sweep.name))
    except C.ConfigError as e:
        print(f"sweep config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for sweep, out in zip(sweeps, outs):
            for run in sweep.runs:
                run_dir = os.path.abspath(os.path.join(out, run.name))
                print(shlex.join(command(sweep, run, run_dir)))
        return 0
    started_ray = False
    if args.ray:
        import ray

        if not ray.is_initialized():
            address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            started_ray = True
    ok = True
    try:
        for sweep, out in zip(sweeps, outs):
            rows = run_sweep(
                sweep, out, parallel=args.parallel, ray_cpus=args.ray_cpus if args.ray else None
            )
            print()
            if parts:
                print(f"## {sweep.name}\n")
            print(markdown_table(rows), end="")
            results = f"{os.path.join(out, 'results.csv')}, {os.path.join(out, 'results.md')}"
            print(f"\nresults: {results}")
            ok = ok and all(r["status"] == "ok" for r in rows)
    finally:
        if started_ray:
            ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
