"""Analysis: loading run directories, every plot, tables, and the notebook run headlessly.

All run directories here are SYNTHETIC data made up to exercise the plotting code; the
numbers mean nothing about any real training run.
"""

import json
import math
from pathlib import Path

import pytest
import yaml

from rl import analysis

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_synthetic_run(run_dir: Path, mode: str, *, updates: int = 12, full: bool = True):
    """A fake run directory (SYNTHETIC metrics.jsonl + config.yaml) for the plotting tests."""
    run_dir.mkdir(parents=True)
    eta = 0 if mode == "sync" else 2
    config = {"name": run_dir.name, "trainer": {"mode": mode, "max_staleness": eta}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    t = 0.0
    for step in range(updates + 1):
        t += 3.0 if mode == "sync" else 2.0
        row = {"step": step, "version": step, "time": t, "reward/mean": 0.05 * step}
        if full:
            row.update({"reward/std": 0.1, "throughput/tokens_per_s": 1000.0 + 10 * step})
            row.update({"timing/weight_sync": 0.3, "timing/train_step": 1.0})
            row.update({"idle/learner": 0.5 if mode == "sync" else 0.1, "idle/rollout": 0.4})
            fr = [1.0, 0.0, 0.0] if mode == "sync" else [0.5, 0.3, 0.2]
            row.update({f"staleness/frac_{k}": fr[k] if k < 3 else 0.0 for k in range(9)})
            row.update({"staleness/frac_gt8": 0.0, "staleness/mean": fr[1] + 2 * fr[2]})
            row["staleness/max"] = 0.0 if mode == "sync" else 2.0
            if step == 3:
                row["timing/weight_sync"] = None  # a null, as non-finite values are written
        rows.append(row)
        if step % 4 == 0:  # evaluation logged on its own line at the same step
            rows.append({"step": step, "version": step, "time": t, "eval/accuracy": step / 16})
    lines = [json.dumps(r) for r in rows]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


@pytest.fixture
def synthetic_runs(tmp_path):
    root = tmp_path / "runs"
    write_synthetic_run(root / "synthetic-sync", "sync")
    write_synthetic_run(root / "synthetic-async", "async")
    (root / "_not_a_run").mkdir()
    sweep = root / "synthetic-sweep"
    sweep.mkdir()
    (sweep / "results.csv").write_text("name,mode,eval_accuracy\nsync,sync,0.75\nasync,async,0.8\n")
    return root


def assert_png(path):
    """A decodable PNG with something drawn on it (not one uniform colour)."""
    from matplotlib.image import imread

    path = Path(path)
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    pixels = imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0.01, path


def test_load_run_reads_metrics_and_config(synthetic_runs):
    run = analysis.load_run(synthetic_runs / "synthetic-async")
    assert run.name == "synthetic-async" and run.mode == "async"
    assert run.config["trainer"]["max_staleness"] == 2
    df = run.metrics
    assert len(df) == 13 + 4  # 13 update lines + 4 evaluation lines (steps 0, 4, 8, 12)
    assert df["reward/mean"].dropna().tolist() == pytest.approx([0.05 * s for s in range(13)])
    assert df["eval/accuracy"].dropna().tolist() == [0.0, 0.25, 0.5, 0.75]
    assert math.isnan(df.loc[df["step"] == 3, "timing/weight_sync"].iloc[0])
    assert run.has("staleness/frac_1") and not run.has("nothing/here")


def test_load_runs_glob_skips_non_runs_and_errors_when_empty(synthetic_runs, tmp_path):
    runs = analysis.load_runs(str(synthetic_runs / "*"))
    assert [r.name for r in runs] == ["synthetic-async", "synthetic-sync"]
    runs = analysis.load_runs([synthetic_runs / "synthetic-sync", str(synthetic_runs / "*sync")])
    assert [r.name for r in runs] == ["synthetic-sync", "synthetic-async"]
    with pytest.raises(FileNotFoundError, match="no run directory"):
        analysis.load_runs(str(tmp_path / "nothing" / "*"))
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        analysis.load_run(synthetic_runs / "_not_a_run")


def test_every_plot_writes_a_png(synthetic_runs, tmp_path):
    runs = analysis.load_runs(str(synthetic_runs / "*"))
    out = tmp_path / "figs"
    paths = [
        analysis.plot_reward(runs, x="step", out=out / "r_step.png"),
        analysis.plot_reward(runs, x="time", out=out / "r_time.png"),
        analysis.plot_eval(runs, x="step", out=out / "e_step.png"),
        analysis.plot_eval(runs, x="time", out=out / "e_time.png"),
        analysis.plot_staleness(runs, out=out / "staleness.png"),
        analysis.plot_idle(runs, out=out / "idle.png"),
        analysis.plot_throughput(runs, out=out / "throughput.png"),
    ]
    assert [p.name for p in paths] == [
        "r_step.png", "r_time.png", "e_step.png", "e_time.png", "staleness.png", "idle.png",
        "throughput.png",
    ]  # fmt: skip
    for p in paths:
        assert_png(p)
    with pytest.raises(ValueError, match="valid choices"):
        analysis.plot_reward(runs, x="epoch", out=out / "bad.png")


def test_missing_metrics_are_skipped_with_a_note(tmp_path, capsys):
    bare = analysis.load_run(write_synthetic_run(tmp_path / "synthetic-bare", "sync", full=False))
    for fn in (analysis.plot_staleness, analysis.plot_idle, analysis.plot_throughput):
        assert_png(fn([bare], out=tmp_path / f"{fn.__name__}.png"))
    assert_png(analysis.plot_eval(bare, out=tmp_path / "eval.png"))
    notes = capsys.readouterr().out
    assert "synthetic-bare: no staleness/frac_* metrics; skipped" in notes
    assert "synthetic-bare: no idle/learner; skipped" in notes
    assert "no timing/* metrics" in notes


def test_run_summary_and_sweep_table(synthetic_runs):
    runs = analysis.load_runs(str(synthetic_runs / "*"))
    table = analysis.run_summary(runs, target_accuracy=0.5)
    sync, asyn = table.loc["synthetic-sync"], table.loc["synthetic-async"]
    assert sync["mode"] == "sync" and sync["updates"] == 12
    assert sync["wall_s"] == 39.0 and asyn["wall_s"] == 26.0
    assert asyn["reward_final"] == pytest.approx(0.6)
    assert (asyn["eval_first"], asyn["eval_final"], asyn["eval_best"]) == (0.0, 0.75, 0.75)
    # eval/accuracy first reaches 0.5 at step 8: time 9 * 3 s (sync) and 9 * 2 s (async).
    assert sync["time_to_0.5_s"] == 27.0 and asyn["time_to_0.5_s"] == 18.0
    assert asyn["staleness_mean"] == pytest.approx(0.7) and asyn["staleness_max"] == 2.0
    sweep = analysis.sweep_table(synthetic_runs / "synthetic-sweep")
    assert sweep["eval_accuracy"].tolist() == [0.75, 0.8]
    with pytest.raises(FileNotFoundError, match="expected a CSV"):
        analysis.sweep_table(synthetic_runs / "missing.csv")


def write_study_csv(path):
    """A staleness study's results.csv: three seeds per cell and one failed run."""
    rows = ["run,seed,trainer.max_staleness,algorithm.loss,status,eval/accuracy:final"]
    acc = {("ppo_clip", 0): [0.5, 0.6, 0.7], ("ppo_clip", 8): [0.2, 0.3, 0.1]}
    acc[("decoupled_ppo", 8)] = [0.6, 0.6, 0.6]
    for (loss, eta), values in acc.items():
        for seed, a in enumerate(values):
            rows.append(f"r,{seed},{eta},{loss},ok,{a}")
    rows.append("r,3,8,ppo_clip,failed,")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_seed_study_statistics_and_plot(tmp_path):
    """Mean and sample std over seeds per cell; failed runs left out; the plot is written."""
    write_study_csv(tmp_path / "results.csv")
    x, by, m = "trainer.max_staleness", "algorithm.loss", "eval/accuracy:final"
    stats = analysis.seed_stats(tmp_path, x, by, m).set_index([by, x])
    assert stats.loc[("ppo_clip", 0), "mean"] == pytest.approx(0.6)
    assert stats.loc[("ppo_clip", 0), "std"] == pytest.approx(0.1)  # sample std (ddof 1)
    assert stats.loc[("ppo_clip", 8), "count"] == 3 and stats.loc[("ppo_clip", 8), "mean"] == (
        pytest.approx(0.2)
    )
    assert stats.loc[("decoupled_ppo", 8), "std"] == pytest.approx(0.0)
    png = analysis.plot_seed_study(tmp_path, x, by, m, out=tmp_path / "s.png", baseline=0.2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="no column"):
        analysis.seed_stats(tmp_path, "trainer.nope", by, m)


def test_paired_gaps_against_the_a_a_noise_floor(tmp_path):
    """Gaps b - a paired by seed (SYNTHETIC runs): mean, sample std, standard error; the A/A
    cell's gap is the floor; only a gap beyond it by two standard errors each is decided."""
    # per (eta, loss): the last values by seed 0, 1, 2 (the mean of the last two logged)
    last = {
        (0, "a"): [0.30, 0.40, 0.50],
        (0, "b"): [0.32, 0.38, 0.56],  # A/A: gaps 0.02, -0.02, 0.06
        (8, "a"): [0.20, 0.25, 0.30],
        (8, "b"): [0.40, 0.46, 0.49],  # gaps 0.20, 0.21, 0.19: decided
        (4, "a"): [0.30, 0.30, 0.30],
        (4, "b"): [0.35, 0.25, 0.40],  # gaps 0.05, -0.05, 0.10: within the floor
    }
    for (eta, loss), values in last.items():
        for seed, v in enumerate(values):
            d = tmp_path / f"eta{eta}-{loss}-{seed}"
            d.mkdir()
            config = {"seed": seed, "trainer": {"max_staleness": eta}, "algorithm": {"loss": loss}}
            (d / "config.yaml").write_text(yaml.safe_dump(config))
            rows = [{"step": 0, "m": 9.0}, {"step": 1, "m": v - 0.01}, {"step": 2, "m": v + 0.01}]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = analysis.load_runs(str(tmp_path / "eta*"))
    x = "trainer.max_staleness"
    t = analysis.paired_gaps(runs, x, "algorithm.loss", "a", "b", "m", last=2, floor_at=0)
    t = t.set_index(x)
    assert t.loc[0, "gap"] == pytest.approx(0.02) and t.loc[8, "gap"] == pytest.approx(0.2)
    assert t.loc[0, "std"] == pytest.approx(0.04)  # sample std (ddof 1) of 0.02, -0.02, 0.06
    assert t.loc[8, "se"] == pytest.approx(0.01 / math.sqrt(3))
    assert (t["n"] == 3).all() and t["floor"].tolist() == pytest.approx([0.02] * 3)
    assert t["decided"].tolist() == [False, False, True]  # eta 0 (the floor), 4, 8
    with pytest.raises(KeyError, match="noise floor"):
        analysis.paired_gaps(runs, x, "algorithm.loss", "a", "b", "m", floor_at=2)


def write_arm_runs(root: Path, finals: dict[str, list[float]], varying: str = "") -> None:
    """SYNTHETIC sweep runs <arm>_seed-<n>: evaluations at updates 0, 2, 4 rising linearly to
    the arm's final accuracy for that seed; the staleness bound 2, or cycling 0-2 for `varying`."""
    for arm, values in finals.items():
        for seed, final in enumerate(values):
            d = root / f"{arm}_seed-{seed}"
            d.mkdir(parents=True)
            (d / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
            rows = []
            for step in range(5):
                bound = float(step % 3) if arm == varying else 2.0
                rows.append({"step": step, "time": 10.0 * step, "staleness/bound": bound})
                if step % 2 == 0:  # evaluations at 0, 2, 4: the last one is the final
                    acc = final * step / 4
                    rows.append({"step": step, "time": 10.0 * step + 1, "eval/accuracy": acc})
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_arm_table_time_to_target_and_gap_against_the_floor(tmp_path):
    """Sweep runs named <arm>_seed-<n> (SYNTHETIC): per run the final accuracy, the updates and
    seconds to the first evaluation at the target; per arm over seeds; a paired gap."""
    finals = {"base": [0.5, 0.6, 0.7], "twin": [0.52, 0.58, 0.74], "fast": [0.8, 0.9, 0.95]}
    write_arm_runs(tmp_path, finals, varying="fast")
    runs = analysis.load_runs(str(tmp_path / "*_seed-*"))
    assert sorted({analysis.arm_of(r) for r in runs}) == ["base", "fast", "twin"]
    table = analysis.arm_table(runs, target_accuracy=0.4)
    assert table.loc[("base", 0), "accuracy_final"] == pytest.approx(0.5)
    # base seed 0 reaches 0.4 at step 4 (0.25 at step 2); fast seed 0 at step 2 (0.4)
    assert table.loc[("base", 0), "updates_to_target"] == 4
    assert table.loc[("base", 0), "seconds_to_target"] == pytest.approx(41.0)
    assert table.loc[("fast", 0), "updates_to_target"] == 2
    assert table.loc[("fast", 1), "eta_mean"] == pytest.approx((0 + 1 + 2 + 0 + 1) / 5)
    summary = analysis.arm_summary(table)
    assert summary.loc["base", "accuracy_final_mean"] == pytest.approx(0.6)
    assert summary.loc["base", "accuracy_final_std"] == pytest.approx(0.1)
    assert summary.loc["fast", "updates_to_target_n"] == 3
    gap = analysis.arm_gap(table, "base", "fast", "accuracy_final", floor=("base", "twin"))
    assert gap["gap"] == pytest.approx((0.3 + 0.3 + 0.25) / 3) and gap["n"] == 3
    assert gap["floor"] == pytest.approx((0.02 - 0.02 + 0.04) / 3) and gap["decided"]
    twin = analysis.arm_gap(table, "base", "twin", "accuracy_final", floor=("base", "twin"))
    assert not twin["decided"]
    png = analysis.plot_arms(runs, out=tmp_path / "arms.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_notebook_executes_headlessly(synthetic_runs, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    out = tmp_path / "nb_out"
    monkeypatch.setenv("TANDEM_RUN_DIRS", str(synthetic_runs / "*"))
    monkeypatch.setenv("TANDEM_OUT_DIR", str(out))
    (tmp_path / "staleness").mkdir()  # the study's plot is named after its directory
    study = write_study_csv(tmp_path / "staleness" / "results.csv")
    monkeypatch.setenv("TANDEM_STUDY_CSV", str(study))
    finals = {"eta0": [0.5, 0.6], "eta0-ppo-clip": [0.5, 0.62], "adaptive": [0.6, 0.7]}
    write_arm_runs(tmp_path / "adaptive", finals, varying="adaptive")
    monkeypatch.setenv("TANDEM_ADAPTIVE_RUNS", str(tmp_path / "adaptive" / "*_seed-*"))
    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    assert "RUN_DIRS" in nb.cells[1].source and "parameters" in nb.cells[1].metadata["tags"]
    client = nbclient.NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    )
    client.execute()  # raises CellExecutionError on any failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    for name in ("reward_vs_step", "reward_vs_time", "eval_vs_step", "eval_vs_time",
                 "staleness", "idle", "throughput", "staleness_study",
                 "adaptive_staleness"):  # fmt: skip
        assert_png(out / f"{name}.png")
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 9
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "synthetic-async" in html  # the run summary table
    assert "eval_accuracy" in html  # the sweep table found next to the runs
    assert "accuracy_final_mean" in html  # the adaptive study's table per arm
