"""Metric analysis of run directories: load runs, plot to PNG files, sweep tables.

Every plot function takes a list of runs, saves one figure and returns its path. A metric
that a run did not log is skipped with a printed note (a synchronous run has no staleness
beyond 0; a run without evaluation has no eval curve), never an error. pandas and matplotlib
are imported lazily; figures are drawn with the Agg canvas, so nothing touches pyplot's
global state or needs a display.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rl.metrics import (
    EVAL_ACCURACY,
    IDLE_LEARNER,
    IDLE_ROLLOUT,
    MAX_STALENESS_BIN,
    METRICS_FILE,
    REWARD,
    TOKENS_PER_S,
    WEIGHT_SYNC,
    read_metrics,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

X_AXES = ("step", "time", "version")
X_LABELS = {"step": "update", "time": "wall clock (s)", "version": "policy version"}
STALENESS_BINS = [f"staleness/frac_{k}" for k in range(MAX_STALENESS_BIN + 1)] + [
    f"staleness/frac_gt{MAX_STALENESS_BIN}"
]


@dataclasses.dataclass
class Run:
    """One run directory: its metrics (one row per metrics.jsonl line) and resolved config."""

    name: str
    path: Path
    metrics: pd.DataFrame
    config: dict[str, Any]

    @property
    def mode(self) -> str:
        """Trainer mode from the config ("sync", "one_step_off", "async"), or "?"."""
        return str((self.config.get("trainer") or {}).get("mode", "?"))

    def has(self, metric: str) -> bool:
        """Whether the run logged at least one non-null value of `metric`."""
        return metric in self.metrics.columns and bool(self.metrics[metric].notna().any())


def _note(msg: str) -> None:
    print(f"note: {msg}")


# ---------------------------------------------------------------------------------------------
# Loading


def load_run(run_dir: str | os.PathLike) -> Run:
    """Load `run_dir/metrics.jsonl` (and `config.yaml` when present) into a Run."""
    import pandas as pd

    path = Path(run_dir)
    metrics_path = path / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: {path} is not a run directory")
    rows = read_metrics(metrics_path)
    df = pd.DataFrame.from_records(rows) if rows else pd.DataFrame()
    for col in ("step", "version", "time"):
        if col not in df.columns:
            df[col] = pd.Series(dtype="float64")
    df = df.apply(pd.to_numeric, errors="coerce")
    config: dict[str, Any] = {}
    config_path = path / "config.yaml"
    if config_path.is_file():
        config = yaml.safe_load(config_path.read_text()) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a mapping, got {type(config).__name__}")
    else:
        _note(f"{path.name}: no config.yaml")
    return Run(name=path.name, path=path, metrics=df, config=config)


def load_runs(paths_or_glob: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Run]:
    """Load every run directory named or matched (globs skip folders without metrics.jsonl)."""
    items = (
        [paths_or_glob] if isinstance(paths_or_glob, (str, os.PathLike)) else list(paths_or_glob)
    )
    dirs: list[Path] = []
    for item in items:
        s = os.fspath(item)
        if glob.has_magic(s):
            dirs += [Path(p) for p in sorted(glob.glob(s)) if (Path(p) / METRICS_FILE).is_file()]
        else:
            dirs.append(Path(s))
    unique = list(dict.fromkeys(p.resolve() for p in dirs))
    if not unique:
        raise FileNotFoundError(f"no run directory (with {METRICS_FILE}) matches {items}")
    return [load_run(p) for p in unique]


def _as_runs(runs: Run | Sequence[Run]) -> list[Run]:
    return [runs] if isinstance(runs, Run) else list(runs)


def _series(run: Run, x: str, metric: str) -> tuple[Any, Any] | None:
    """(x values, metric values) of rows where the metric is logged; last row per x wins."""
    if x not in X_AXES:
        raise ValueError(f"x={x!r}: valid choices are {X_AXES}")
    if not run.has(metric):
        return None
    df = run.metrics[[x, metric]].dropna()
    df = df.drop_duplicates(subset=x, keep="last").sort_values(x)
    return df[x].to_numpy(), df[metric].to_numpy()


# ---------------------------------------------------------------------------------------------
# Figures


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (6.0, 4.0)):
    """A standalone Agg figure with a grid of axes (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Figure, out: str | os.PathLike) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    return path


def _integer_ticks(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _line_panel(
    ax: Axes,
    runs: list[Run],
    x: str,
    metric: str,
    *,
    marker: str = "",
    band: bool = False,
    label_mean: bool = False,
) -> int:
    """One line per run that logged `metric`; returns how many were drawn."""
    drawn = 0
    for i, run in enumerate(runs):
        xy = _series(run, x, metric)
        if xy is None:
            _note(f"{run.name}: no {metric}; skipped")
            continue
        xs, ys = xy
        label = f"{run.name} (mean {ys.mean():.2f})" if label_mean else run.name
        ax.plot(xs, ys, marker=marker, markersize=3, color=f"C{i % 10}", label=label)
        std_name = metric[: -len("/mean")] + "/std" if metric.endswith("/mean") else ""
        sd = _series(run, x, std_name) if band and std_name else None
        if sd is not None and len(sd[0]) == len(xs):
            ax.fill_between(xs, ys - sd[1], ys + sd[1], color=f"C{i % 10}", alpha=0.15)
        drawn += 1
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if x != "time":
        _integer_ticks(ax)
    if drawn:
        ax.legend(fontsize=8)
    else:
        _empty(ax, f"no run logged {metric}")
    return drawn


def plot_reward(
    runs: Run | Sequence[Run],
    x: str = "step",
    metric: str = REWARD,
    out: str | os.PathLike = "reward.png",
) -> Path:
    """Training reward (mean +- std band when logged) per run against update or wall clock."""
    fig, (ax,) = _figure()
    _line_panel(ax, _as_runs(runs), x, metric, band=True)
    ax.set_title(f"{metric} vs {X_LABELS[x]}")
    return _save(fig, out)


def plot_eval(
    runs: Run | Sequence[Run],
    x: str = "step",
    metric: str = EVAL_ACCURACY,
    out: str | os.PathLike = "eval.png",
) -> Path:
    """Held-out evaluation (eval/accuracy by default) per run against update or wall clock."""
    fig, (ax,) = _figure()
    _line_panel(ax, _as_runs(runs), x, metric, marker="o")
    ax.set_title(f"{metric} vs {X_LABELS[x]}")
    return _save(fig, out)


def plot_staleness(runs: Run | Sequence[Run], out: str | os.PathLike = "staleness.png") -> Path:
    """Per run: token fraction at each staleness per policy version; last: overall histogram."""
    runs = _as_runs(runs)
    with_data = []
    for run in runs:
        if any(run.has(c) for c in STALENESS_BINS):
            with_data.append(run)
        else:
            _note(f"{run.name}: no staleness/frac_* metrics; skipped")
    n = len(with_data) + 1
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, axes = _figure(nrows, ncols, size=(5.0, 3.6))
    for ax in axes[n:]:
        ax.set_axis_off()
    labels = [f"{k}" for k in range(MAX_STALENESS_BIN + 1)] + [f">{MAX_STALENESS_BIN}"]
    colors = [_staleness_color(k) for k in range(len(labels))]
    hist_ax = axes[n - 1]
    if not with_data:
        _empty(hist_ax, "no run logged staleness metrics")
        return _save(fig, out)
    width = 0.8 / len(with_data)
    for i, (run, ax) in enumerate(zip(with_data, axes)):
        cols = [c for c in STALENESS_BINS if c in run.metrics.columns]
        df = run.metrics[["version", *cols]].dropna(subset=cols, how="all")
        by_version = df.groupby("version")[cols].mean().fillna(0.0)
        ax.stackplot(
            by_version.index.to_numpy(),
            *[by_version[c].to_numpy() for c in cols],
            labels=[labels[STALENESS_BINS.index(c)] for c in cols],
            colors=[colors[STALENESS_BINS.index(c)] for c in cols],
        )
        ax.set_ylim(0, 1)
        _integer_ticks(ax)
        ax.set_xlabel("policy version (update)")
        ax.set_ylabel("fraction of trained tokens")
        ax.set_title(f"{run.name}: staleness per version", fontsize=10)
        if i == 0:  # the colours are the same in every panel
            ax.legend(title="staleness", fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
        overall = [float(df[c].mean()) if c in cols else 0.0 for c in STALENESS_BINS]
        pos = [k - 0.4 + width * (i + 0.5) for k in range(len(labels))]
        hist_ax.bar(pos, overall, width=width, color=f"C{runs.index(run) % 10}", label=run.name)
    hist_ax.set_xticks(range(len(labels)), labels)
    hist_ax.set_xlabel("staleness (versions)")
    hist_ax.set_ylabel("fraction of trained tokens (mean over updates)")
    hist_ax.set_title("staleness histogram", fontsize=10)
    hist_ax.grid(alpha=0.3, axis="y")
    hist_ax.legend(fontsize=8)
    return _save(fig, out)


def _staleness_color(k: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](k / (MAX_STALENESS_BIN + 1))


def plot_idle(
    runs: Run | Sequence[Run], out: str | os.PathLike = "idle.png", *, x: str = "step"
) -> Path:
    """Fraction of wall time the learner and the rollout side spent waiting, per run."""
    runs = _as_runs(runs)
    fig, axes = _figure(1, 2)
    for ax, metric in zip(axes, (IDLE_LEARNER, IDLE_ROLLOUT)):
        _line_panel(ax, runs, x, metric, label_mean=True)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{metric} (fraction of wall time waiting)", fontsize=10)
    return _save(fig, out)


def plot_throughput(
    runs: Run | Sequence[Run], out: str | os.PathLike = "throughput.png", *, x: str = "step"
) -> Path:
    """Generated tokens/s and weight-sync seconds per update; share of wall time per timing."""
    runs = _as_runs(runs)
    fig, axes = _figure(1, 3, size=(5.0, 3.8))
    _line_panel(axes[0], runs, x, TOKENS_PER_S)
    axes[0].set_title("generation throughput", fontsize=10)
    _line_panel(axes[1], runs, x, WEIGHT_SYNC, marker=".")
    axes[1].set_title("weight sync seconds per update", fontsize=10)
    ax = axes[2]
    timing = sorted({c for r in runs for c in r.metrics.columns if c.startswith("timing/")})
    shares = {}
    for run in runs:
        wall = run.metrics["time"].max()
        if any(run.has(c) for c in timing) and wall > 0:
            shares[run.name] = [
                float(run.metrics[c].sum()) / wall if c in run.metrics.columns else 0.0
                for c in timing
            ]
    if not shares:
        _note("no timing/* metrics in any run; wall-time shares skipped")
        _empty(ax, "no timing/* metrics")
        return _save(fig, out)
    width = 0.8 / len(shares)
    for i, run in enumerate(runs):
        if run.name in shares:
            pos = [k - 0.4 + width * (i + 0.5) for k in range(len(timing))]
            ax.barh(pos, shares[run.name], height=width, color=f"C{i % 10}", label=run.name)
    ax.set_yticks(range(len(timing)), [c.removeprefix("timing/") for c in timing])
    ax.set_xlabel("share of wall time (sum of timing / run time)")
    ax.set_title("where the time went", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    return _save(fig, out)


# ---------------------------------------------------------------------------------------------
# Tables


def run_summary(runs: Run | Sequence[Run], target_accuracy: float | None = None) -> pd.DataFrame:
    """One row per run: updates, wall time, final reward, eval, staleness, idle, throughput."""
    import pandas as pd

    def first(run: Run, m: str) -> float:
        return float(run.metrics[m].dropna().iloc[0]) if run.has(m) else float("nan")

    def last(run: Run, m: str) -> float:
        return float(run.metrics[m].dropna().iloc[-1]) if run.has(m) else float("nan")

    def agg(run: Run, m: str, how: str) -> float:
        return float(getattr(run.metrics[m].dropna(), how)()) if run.has(m) else float("nan")

    rows = []
    for run in _as_runs(runs):
        row = {
            "run": run.name,
            "mode": run.mode,
            "updates": agg(run, "step", "max"),
            "wall_s": agg(run, "time", "max"),
            "reward_final": last(run, REWARD),
            "eval_first": first(run, EVAL_ACCURACY),
            "eval_final": last(run, EVAL_ACCURACY),
            "eval_best": agg(run, EVAL_ACCURACY, "max"),
            "staleness_mean": agg(run, "staleness/mean", "mean"),
            "staleness_max": agg(run, "staleness/max", "max"),
            "idle_learner": agg(run, IDLE_LEARNER, "mean"),
            "idle_rollout": agg(run, IDLE_ROLLOUT, "mean"),
            "tokens_per_s": agg(run, TOKENS_PER_S, "mean"),
        }
        if target_accuracy is not None:
            reached = float("nan")  # wall clock of the first evaluation at or above the target
            if run.has(EVAL_ACCURACY):
                ev = run.metrics[["time", EVAL_ACCURACY]].dropna()
                hit = ev[ev[EVAL_ACCURACY] >= target_accuracy]
                reached = float(hit["time"].iloc[0]) if len(hit) else reached
            row[f"time_to_{target_accuracy:g}_s"] = reached
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def sweep_table(results_csv: str | os.PathLike) -> pd.DataFrame:
    """The results table a sweep wrote (a CSV file, or a directory holding results.csv)."""
    import pandas as pd

    path = Path(results_csv)
    if path.is_dir():
        path = path / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"sweep results {path} not found (expected a CSV file)")
    return pd.read_csv(path)


def seed_stats(results_csv: str | os.PathLike, x: str, by: str, metric: str) -> pd.DataFrame:
    """A sweep's `metric` column (e.g. "eval/accuracy:final") over seeds: mean, std (sample,
    ddof 1) and count of the ok runs per (by, x) cell, e.g. by="algorithm.loss",
    x="trainer.max_staleness"."""
    table = sweep_table(results_csv)
    missing = [c for c in (x, by, metric) if c not in table.columns]
    if missing:
        raise KeyError(f"{results_csv}: no column(s) {missing}; columns: {list(table.columns)}")
    if "status" in table.columns:
        table = table[table["status"] == "ok"]
    stats = table.groupby([by, x])[metric].agg(["mean", "std", "count"])
    return stats.reset_index().sort_values([by, x])


def plot_seed_study(
    results_csv: str | os.PathLike,
    x: str,
    by: str,
    metric: str,
    out: str | os.PathLike = "study.png",
    baseline: float | None = None,
) -> Path:
    """Mean +- std over seeds of a sweep's `metric` against `x`, one line per value of `by`
    (seed_stats); baseline: a horizontal reference (e.g. the warm start's accuracy)."""
    stats = seed_stats(results_csv, x, by, metric)
    fig, (ax,) = _figure(size=(6.0, 4.0))
    for i, (name, df) in enumerate(stats.groupby(by)):
        xs, mean, std = df[x].to_numpy(), df["mean"].to_numpy(), df["std"].fillna(0.0).to_numpy()
        n = int(df["count"].min())
        ax.errorbar(
            xs, mean, yerr=std, marker="o", capsize=4, color=f"C{i}", label=f"{name} (n={n})"
        )
    if baseline is not None:
        ax.axhline(baseline, color="0.5", linestyle="--", linewidth=1, label="start")
    ax.set_xlabel(x)
    ax.set_ylabel(f"{metric} (mean +- std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def _config_value(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def paired_gaps(
    runs: Sequence[Run],
    x: str,
    by: str,
    a: Any,
    b: Any,
    metric: str,
    *,
    last: int = 1,
    floor_at: Any = None,
) -> pd.DataFrame:
    """A paired comparison of two settings of `by` (config keys, dotted) over seeds: per value of
    `x`, the gap b - a of each seed's `metric` (the mean of its last `last` logged values), and
    the gaps' mean, sample std, standard error and count. `floor_at`: the value of x where a and
    b compute the same thing (an A/A pair); its mean gap is every row's noise floor, and a row is
    `decided` when its gap, two standard errors in, is beyond the floor's magnitude plus its
    own two standard errors."""
    import pandas as pd

    cells: dict[tuple, float] = {}
    for run in runs:
        key = (_config_value(run.config, x), _config_value(run.config, by), run.config.get("seed"))
        if not run.has(metric):
            _note(f"{run.name}: no {metric}")
            continue
        cells[key] = float(run.metrics[metric].dropna().iloc[-last:].mean())
    rows = []
    for xv in sorted({k[0] for k in cells}):
        seeds = sorted(s for (xx, bv, s) in cells if xx == xv and bv == a)
        gaps = [cells[(xv, b, s)] - cells[(xv, a, s)] for s in seeds if (xv, b, s) in cells]
        if not gaps:
            continue
        rows.append({x: xv, **_gap_stats(gaps)})
    out = pd.DataFrame(rows)
    if floor_at is not None and not out.empty:
        ref = out[out[x] == floor_at]
        if ref.empty:
            raise KeyError(f"no paired runs at {x}={floor_at!r} for the noise floor")
        floor, floor_se = float(ref["gap"].iloc[0]), float(ref["se"].iloc[0])
        out["floor"] = floor
        out["decided"] = _decided(out["gap"].abs(), out["se"], floor, floor_se)
        out.loc[out[x] == floor_at, "decided"] = False
    return out


def _gap_stats(gaps) -> dict[str, float]:
    """Paired gaps' mean, sample std (ddof 1), standard error and count."""
    import numpy as np

    g = np.asarray(gaps, dtype=float)
    std = float(g.std(ddof=1)) if len(g) > 1 else float("nan")
    mean = float(g.mean()) if len(g) else float("nan")
    return {"gap": mean, "std": std, "se": std / np.sqrt(len(g)), "n": len(g)}


def _decided(gap_abs, se, floor: float, floor_se: float):
    """A gap is decided when, two standard errors in, it lies beyond the A/A floor's magnitude
    plus two of the floor's standard errors."""
    return (gap_abs - 2 * se) > abs(floor) + 2 * floor_se


# ---------------------------------------------------------------------------------------------
# Studies of settings over seeds (sweep runs named <setting>_seed-<n>)


def arm_of(run: Run) -> str:
    """A sweep run's setting: its name without the sweep's `_seed-<n>` suffix."""
    import re

    return re.sub(r"_seed-\d+$", "", run.name)


def arm_table(runs: Sequence[Run], target_accuracy: float) -> pd.DataFrame:
    """One row per run, indexed by (arm, seed): the final held-out accuracy, the updates and
    wall-clock seconds to the first evaluation at or above target_accuracy (NaN: never), the
    run's wall clock, its mean trained staleness and its mean staleness bound (eta)."""
    import numpy as np
    import pandas as pd

    rows = []
    for run in runs:
        m = run.metrics
        ev = m[["step", "time", EVAL_ACCURACY]].dropna() if run.has(EVAL_ACCURACY) else None
        hit = None if ev is None else ev[ev[EVAL_ACCURACY] >= target_accuracy]
        reached = hit is not None and len(hit) > 0

        rows.append(
            {
                "arm": arm_of(run),
                "seed": run.config.get("seed"),
                "accuracy_final": float(ev[EVAL_ACCURACY].iloc[-1]) if ev is not None else np.nan,
                "updates_to_target": float(hit["step"].iloc[0]) if reached else np.nan,
                "seconds_to_target": float(hit["time"].iloc[0]) if reached else np.nan,
                "wall_s": float(m["time"].max()),
                "staleness_mean": _mean(run, "staleness/mean"),
                "eta_mean": _mean(run, "staleness/bound"),
            }
        )
    return pd.DataFrame(rows).set_index(["arm", "seed"]).sort_index()


def _mean(run: Run, metric: str) -> float:
    return float(run.metrics[metric].dropna().mean()) if run.has(metric) else float("nan")


def arm_summary(table: pd.DataFrame) -> pd.DataFrame:
    """arm_table's columns over seeds per arm: mean, sample std, and n (runs with a value;
    for the *_to_target columns, the runs that reached the target)."""
    grouped = table.groupby(level="arm")
    out = grouped.agg(["mean", "std", "count"])
    out.columns = [f"{c}_{s}" if s != "count" else f"{c}_n" for c, s in out.columns]
    return out


def arm_gap(
    table: pd.DataFrame, a: str, b: str, column: str, floor: tuple[str, str]
) -> dict[str, float]:
    """The gap b - a of arm_table's `column`, paired by seed (seeds where both have a value):
    mean, sample std, standard error, n; and the same for the A/A pair `floor` (two arms that
    compute the same thing). `decided`: the gap, two standard errors in, lies beyond the
    floor's magnitude plus two of the floor's standard errors (as paired_gaps)."""

    def paired(x: str, y: str) -> dict[str, float]:
        both = table[column].unstack("arm")[[x, y]].dropna()
        return _gap_stats((both[y] - both[x]).to_numpy())

    out, f = paired(a, b), paired(*floor)
    out.update(floor=f["gap"], floor_se=f["se"], floor_n=f["n"])
    out["decided"] = bool(_decided(abs(out["gap"]), out["se"], f["gap"], f["se"]))
    return out


def plot_arms(
    runs: Sequence[Run],
    out: str | os.PathLike = "arms.png",
    arms: Sequence[str] | None = None,
) -> Path:
    """Two panels: held-out accuracy against wall clock (per arm, the mean over seeds at each
    evaluated update, placed at the mean wall clock of that update), and the staleness bound
    eta against the update of every run (one line per run, coloured by arm)."""
    import numpy as np

    by_arm: dict[str, list[Run]] = {}
    for run in runs:
        by_arm.setdefault(arm_of(run), []).append(run)
    names = list(arms) if arms is not None else sorted(by_arm)
    fig, (acc_ax, eta_ax) = _figure(1, 2, size=(12.0, 4.5))
    for i, name in enumerate(names):
        group = by_arm.get(name, [])
        color = f"C{i % 10}"
        curves = [s for s in (_series(r, "step", EVAL_ACCURACY) for r in group) if s is not None]
        clocks = [_series(r, "step", "time") for r in group if r.has(EVAL_ACCURACY)]
        if curves:
            steps = sorted(set.intersection(*(set(s[0].tolist()) for s in curves)))
            acc = [np.mean([s[1][list(s[0]).index(k)] for s in curves]) for k in steps]
            when = [
                np.mean([c[1][list(c[0]).index(k)] for c in clocks if c is not None]) for k in steps
            ]
            acc_ax.plot(when, acc, marker="o", color=color, label=f"{name} (n={len(curves)})")
        for j, run in enumerate(group):
            s = _series(run, "step", "staleness/bound")
            if s is not None:
                eta_ax.plot(*s, color=color, alpha=0.6, label=name if j == 0 else None)
    acc_ax.set_xlabel(X_LABELS["time"])
    acc_ax.set_ylabel("held-out accuracy (mean over seeds)")
    eta_ax.set_xlabel(X_LABELS["step"])
    eta_ax.set_ylabel("staleness bound eta")
    for ax in (acc_ax, eta_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out)
