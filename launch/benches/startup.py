"""python -m launch.bench startup: a training job's start, cold (an empty compilation cache) and
warm (the cache the cold run filled), in one run; with --baseline-ref, the same job at another
commit (a git worktree, no cache) first, as the baseline measured on the same machine.

Each run is `python -m launch.train --config CONFIG` in a process of its own. Measured from its
launch: the time to the step-0 row of metrics.jsonl (the warm start and the first evaluation
done: "before update 0"), to the first update's row, and to the process's exit; from the run's
own metrics, the warm start's training time (sft/time) and, where the code reports them, the
programs compiled and loaded from the cache."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from launch.benches.common import print_result, reject_nonpositive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def run_job(tag: str, args, cwd: str, run_root: str, env: dict, extra: list[str]) -> dict:
    """One job from launch; its figures. Polls metrics.jsonl for the step-0 and step-1 rows."""
    run_dir = os.path.join(run_root, tag)
    cmd = [sys.executable, "-m", "launch.train", "--config", args.config, "--run-dir", run_dir]
    for kv in [*args.set, f"run_root={run_root}", f"name={tag}", *extra]:
        cmd += ["--set", kv]
    os.makedirs(run_root, exist_ok=True)
    log_path = os.path.join(run_root, f"{tag}.log")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    marks: dict[int, float] = {}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if len(marks) < 2:
                for r in _rows(metrics):
                    if r["step"] in (0, 1) and r["step"] not in marks:
                        marks[r["step"]] = time.perf_counter() - t0
            if time.perf_counter() - t0 > args.timeout_s:
                proc.kill()
                proc.wait()
                raise SystemExit(
                    f"{tag}: no exit within --timeout-s={args.timeout_s:g} (log {log_path})"
                )
            time.sleep(0.05)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"{tag}: exit {proc.returncode} (log {log_path}):\n{tail}")
    rows = {r["step"]: r for r in _rows(metrics)}
    r0, r1 = rows.get(0, {}), rows.get(1, {})
    out = {
        "update0_s": marks.get(0, float("nan")),
        "first_update_s": marks.get(1, float("nan")),
        "total_s": total,
        "sft_s": r0.get("sft/time", float("nan")),
        "accuracy_start": r0.get("eval/accuracy", float("nan")),
        "accuracy_end": rows[max(rows)].get("eval/accuracy", float("nan"))
        if rows
        else float("nan"),
    }
    for k in ("compile/programs", "compile/seconds", "compile/cache_hits", "compile/cache_misses"):
        for prefix in ("", "rollout_"):
            if prefix + k in r1:
                out[(prefix + k).replace("/", "_")] = r1[prefix + k]
    print(
        f"{tag}: update 0 at {out['update0_s']:.1f} s, first update {out['first_update_s']:.1f} s,"
        f" exit {total:.1f} s; warm start training {out['sft_s']:.1f} s; held-out accuracy "
        f"{out['accuracy_start']:.3f} -> {out['accuracy_end']:.3f}"
        + (
            f"; programs {out['compile_programs']:.0f} here (cache {out['compile_cache_hits']:.0f}"
            f" hits), {out.get('rollout_compile_programs', 0):.0f} in the rollout process "
            f"(cache {out.get('rollout_compile_cache_hits', 0):.0f} hits)"
            if "compile_programs" in out
            else ""
        ),
        flush=True,
    )
    return out


def _baseline_tree(ref: str, where: str) -> str:
    """A detached git worktree of `ref` (the code to compare against)."""
    path = os.path.join(where, "baseline")
    subprocess.run(
        ["git", "worktree", "add", "--detach", "--force", path, ref],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return path


def run(args) -> dict:
    root = args.root or tempfile.mkdtemp(prefix="bench-startup-")
    os.makedirs(root, exist_ok=True)
    load = os.getloadavg()
    print(
        f"startup bench: {args.config} {' '.join(args.set)}; under {root}; {os.cpu_count()} CPUs, "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
        flush=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    cache = os.path.join(root, "jax-cache")
    result: dict = {}
    tree = None
    try:
        if args.baseline_ref or args.baseline_dir:
            if args.baseline_ref:
                tree = _baseline_tree(args.baseline_ref, root)
            base_dir = tree or os.path.abspath(args.baseline_dir)
            path = os.pathsep.join(p for p in (base_dir, env.get("PYTHONPATH")) if p)
            base_env = {**env, "PYTHONPATH": path}  # its code, not this checkout's
            base = run_job("baseline", args, base_dir, os.path.join(root, "runs"), base_env, [])
            result.update({f"baseline_{k}": v for k, v in base.items()})
        for tag in ("cold", "warm"):
            out = run_job(
                tag, args, ROOT, os.path.join(root, "runs"), env, [f"trainer.compile_cache={cache}"]
            )
            result.update({f"{tag}_{k}": v for k, v in out.items()})
        result["warm_over_cold_update0"] = result["warm_update0_s"] / result["cold_update0_s"]
        result["warm_update0_beyond_sft_s"] = result["warm_update0_s"] - result["warm_sft_s"]
        if "baseline_update0_s" in result:
            for tag in ("cold", "warm"):
                for k in ("update0_s", "total_s"):
                    result[f"{tag}_over_baseline_{k[:-2]}"] = (
                        result[f"{tag}_{k}"] / result[f"baseline_{k}"]
                    )
        return result
    finally:
        if tree is not None:
            subprocess.run(
                ["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True
            )
        if not args.keep and not args.root:
            shutil.rmtree(root, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench startup", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", default="configs/default.yaml", help="the job (README's: default)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    p.add_argument(
        "--baseline-ref",
        help="a git commit to run first as the baseline (its code, in a worktree; no cache)",
    )
    p.add_argument(
        "--baseline-dir",
        help="a checkout of other code to run first as the baseline (where git is not at hand)",
    )
    p.add_argument("--timeout-s", type=float, default=1800.0, help="longest one job may run")
    p.add_argument("--root", help="work directory (default: a temp dir, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temp work directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the startup benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("timeout_s",)):
        return 2
    if args.baseline_ref and args.baseline_dir:
        print("--baseline-ref and --baseline-dir: give one of them", file=sys.stderr)
        return 2
    if args.baseline_dir and not os.path.isfile(
        os.path.join(args.baseline_dir, "launch", "train.py")
    ):
        print(f"--baseline-dir {args.baseline_dir}: no launch/train.py there", file=sys.stderr)
        return 2
    if args.root and os.path.isdir(args.root) and os.listdir(args.root):
        print(  # an earlier bench's runs would resume, its cache make the cold start warm
            f"--root {args.root}: not empty; the bench needs a new or empty work directory",
            file=sys.stderr,
        )
        return 2
    print_result(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
