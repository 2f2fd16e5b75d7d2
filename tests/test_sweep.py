"""launch.sweep: sweep-file validation, run expansion, results, and a real smoke sweep."""

import csv
import glob
import json
import os
import re

import pytest
import yaml

from launch import sweep as S
from rl import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "sweeps", "smoke.yaml")
STALENESS = os.path.join(ROOT, "configs", "sweeps", "staleness.yaml")
BASE = os.path.join(ROOT, "configs", "default.yaml")


def _sets(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]


def _write(tmp_path, data: dict, name: str = "s.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


# --- validation and expansion ----------------------------------------------------------------


def test_staleness_sweep_expands_to_valid_configs():
    sw = S.load(STALENESS)
    assert sw.name == "staleness" and sw.base == BASE
    assert len(sw.runs) == 18
    seen = set()
    for run in sw.runs:
        cmd = S.command(sw, run, f"/tmp/out/{run.name}")
        assert cmd[cmd.index("--run-dir") + 1] == f"/tmp/out/{run.name}"
        cfg = C.load(cmd[cmd.index("--config") + 1], _sets(cmd))
        assert cfg.trainer.mode == "async"
        assert cfg.name == f"staleness/{run.name}"
        # every run starts from the one exported warm start, RL only
        assert (cfg.model.init, cfg.model.path, cfg.sft.steps) == (
            "hf",
            "runs/staleness-warm-start-hf",
            0,
        )
        seen.add((cfg.trainer.max_staleness, cfg.algorithm.loss, cfg.seed))
    cells = {(e, loss) for e in (0, 4, 16) for loss in ("ppo_clip", "decoupled_ppo")}
    assert seen == {(e, loss, seed) for e, loss in cells for seed in (0, 1, 2)}
    assert sw.runs[0].name == "max_staleness-0_loss-ppo_clip_seed-0"
    assert sw.metrics[0] == "eval/accuracy"


SWEEPS = sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml")))


@pytest.mark.parametrize("path", SWEEPS, ids=os.path.basename)
def test_every_sweep_file_expands_to_valid_configs(path):
    for sw in S.load_all(path)[0]:
        assert sw.runs
        for run in sw.runs:
            cmd = S.command(sw, run, f"/tmp/out/{run.name}")
            cfg = C.load(cmd[cmd.index("--config") + 1], _sets(cmd))
            assert cfg.name == f"{sw.name}/{run.name}"


def test_adaptive_staleness_study_is_both_settings():
    path = os.path.join(ROOT, "configs", "sweeps", "adaptive-staleness-study.yaml")
    parts, is_parts = S.load_all(path)
    assert is_parts
    assert [p.name for p in parts] == ["adaptive-staleness", "adaptive-staleness-longtail"]
    assert all(len(p.runs) == 8 * 5 for p in parts)  # 6 fixed eta, adaptive, A/A; 5 seeds


def test_parts_run_one_after_another_into_their_own_directories(tmp_path, capsys):
    a = _write(tmp_path, {"base": BASE, "runs": [{"name": "x"}], "seeds": [0]}, "a.yaml")
    b = {"base": BASE, "name": "bee", "runs": [{"name": "y", "optim.lr": 1e-3}]}
    _write(tmp_path, b, "b.yaml")
    study = _write(tmp_path, {"parts": [os.path.basename(a), "b.yaml"]}, "study.yaml")
    sweeps, is_parts = S.load_all(study)
    assert [s.name for s in sweeps] == ["a", "bee"] and is_parts
    (plain,), is_parts = S.load_all(a)  # a plain file is its own one sweep
    assert plain.name == "a" and not is_parts
    with pytest.raises(C.ConfigError, match="a file of parts; load it with load_all"):
        S.load(study)
    out = tmp_path / "o"
    assert S.main(["--config", study, "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    run_dirs = [line.split("--run-dir ")[1].split()[0] for line in lines]
    assert run_dirs == [str(out / "a" / "x_seed-0"), str(out / "bee" / "y")]
    assert "optim.lr=0.001" in lines[1]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"parts": ["a.yaml"], "seeds": [1]}, "seeds: a file of parts has no other keys"),
        ({"parts": []}, "parts: expected a list of sweep files"),
        ({"parts": ["nope.yaml"]}, r"parts\[0\]: sweep file 'nope.yaml' not found"),
        ({"parts": ["nested.yaml"]}, r"parts\[0\]: 'nested.yaml' has parts itself"),
        ({"parts": ["a.yaml", "a.yaml"]}, "two parts share a name"),
        ({"parts": ["bad.yaml"]}, "bad.yaml: grdi: unknown key"),
    ],
)
def test_parts_errors(tmp_path, data, message):
    _write(tmp_path, {"base": BASE}, "a.yaml")
    _write(tmp_path, {"parts": ["a.yaml"]}, "nested.yaml")
    _write(tmp_path, {"base": BASE, "grdi": {}}, "bad.yaml")
    path = _write(tmp_path, data, "study.yaml")
    with pytest.raises(C.ConfigError, match=message):
        S.load_all(path)


def test_smoke_sweep_is_tiny():
    sw = S.load(SMOKE)
    assert [r.name for r in sw.runs] == ["sync_seed-0", "async_seed-0"]
    for run in sw.runs:
        cmd = S.command(sw, run, "/tmp/x")
        cfg = C.load(BASE, _sets(cmd))
        assert cfg.trainer.total_updates == 2 and cfg.sft.steps == 5
        assert cfg.rollout.prompts_per_update == 4 and cfg.rollout.group_size == 4
        assert cfg.task.num_eval == 16 and cfg.logging.progress is False


def test_names_seeds_and_nested_overrides(tmp_path):
    path = _write(
        tmp_path,
        {
            "base": BASE,
            "name": "abl",
            "set": {"trainer": {"mode": "async"}},
            "grid": {"optim.lr": [1e-4, 0.001], "sft.lr": [0.01]},
            "seeds": [3, 4],
        },
    )
    sw = S.load(path)
    assert sw.common == {"trainer.mode": "async"}
    # both keys end in "lr": the full path names them
    assert [r.name for r in sw.runs] == [
        "optim.lr-0.0001_sft.lr-0.01_seed-3",
        "optim.lr-0.0001_sft.lr-0.01_seed-4",
        "optim.lr-0.001_sft.lr-0.01_seed-3",
        "optim.lr-0.001_sft.lr-0.01_seed-4",
    ]
    cfg = C.load(BASE, _sets(S.command(sw, sw.runs[1], "/tmp/x")))
    assert (cfg.optim.lr, cfg.sft.lr, cfg.seed, cfg.trainer.mode) == (1e-4, 0.01, 4, "async")


def test_runs_list_with_names(tmp_path):
    path = _write(
        tmp_path,
        {
            "base": BASE,
            "runs": [{"name": "a", "task": {"options": {"digits": 3}}}, {"optim.lr": 0.01}, {}],
        },
    )
    sw = S.load(path)
    assert [r.name for r in sw.runs] == ["a", "lr-0.01", "base"]
    assert sw.runs[0].overrides == {"task.options.digits": 3}
    base_options = C.load(BASE).task.options  # a nested override adds to the base's options
    options = C.load(BASE, _sets(S.command(sw, sw.runs[0], "/x"))).task.options
    assert options == {**base_options, "digits": 3}


def test_seed_order_interleaves_the_runs(tmp_path):
    runs = [{"name": "a"}, {"name": "b"}]
    by_run = S.load(_write(tmp_path, {"base": BASE, "runs": runs, "seeds": [3, 1]}))
    assert [r.name for r in by_run.runs] == ["a_seed-3", "a_seed-1", "b_seed-3", "b_seed-1"]
    data = {"base": BASE, "runs": runs, "seeds": [3, 1], "order": "seed"}
    by_seed = S.load(_write(tmp_path, data))
    assert [r.name for r in by_seed.runs] == ["a_seed-3", "b_seed-3", "a_seed-1", "b_seed-1"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"order": "seeds"}, "order: invalid value 'seeds'"),
        ({"grdi": {"optim.lr": [1]}}, "grdi: unknown key; did you mean 'grid'"),
        ({"grid": {"optim.lr": 0.1}}, "grid.optim.lr: expected a list, got 0.1"),
        ({"seeds": ["a"]}, r"seeds\[0\]: expected int, got 'a'"),
        ({"metrics": "eval/accuracy"}, "metrics: expected a list"),
        ({"grid": {"optim.lr": [1]}, "runs": [{}]}, "grid and runs are exclusive"),
        ({"grid": {"optim.lr": []}}, "grid.optim.lr: empty list"),
        ({"base": "nope.yaml"}, "base: config file 'nope.yaml' not found"),
        ({"set": {"trainer.mdoe": "async"}}, "trainer.mdoe: unknown key; did you mean 'mode'"),
        ({"set": {"trainer.mode": "bogus"}}, "trainer.mode: invalid value 'bogus'"),
        ({"runs": [{"name": "x"}, {"name": "x"}]}, r"not unique: \['x'\]"),
        ({"runs": [{"name": "a b"}]}, r"runs\[0\].name: invalid value 'a b'"),
        ({"grid": {"name": ["a"]}}, "grid.name: set by the sweep itself"),
        ({"seeds": [1], "runs": [{"seed": 2}]}, r"runs\[0\].seed: set by the sweep"),
        ({"seeds": [1, 1]}, "duplicate seeds"),
        ([1, 2], "expected a mapping of sweep keys"),
    ],
)
def test_sweep_file_errors(tmp_path, data, message):
    if isinstance(data, dict):
        data = {"base": BASE, **data}
    path = _write(tmp_path, data)
    with pytest.raises(C.ConfigError, match=message) as info:
        S.load(path)
    assert str(info.value).startswith(path)


def test_cli_config_error_exit_code(tmp_path, capsys):
    path = _write(tmp_path, {"base": BASE, "grid": {"optim.lr": 3}})
    assert S.main(["--config", path, "--out", str(tmp_path / "o")]) == 2
    assert "grid.optim.lr: expected a list" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["async", "true", "null", 1e-4, 3, True, None, [1, 2], {}])
def test_set_arg_round_trips(value):
    text = S.set_arg("k", value).split("=", 1)[1]
    parsed = C.apply_overrides({}, [f"k={text}"])["k"]
    assert parsed == value and type(parsed) is type(value)


def test_set_arg_refuses_what_set_cannot_express():
    # --set reads any number-like text as a number, quoted or not
    with pytest.raises(C.ConfigError, match="k: value '1e-3' cannot be passed as --set"):
        S.set_arg("k", "1e-3")


def test_yaml_exponent_floats_are_numbers(tmp_path):
    path = tmp_path / "s.yaml"  # YAML 1.1 itself reads 1e-3 as the string "1e-3"
    path.write_text(f"base: {BASE}\nset: {{optim.lr: 2e-4}}\ngrid: {{sft.lr: [1e-3, 0.01]}}\n")
    sw = S.load(str(path))
    assert sw.common == {"optim.lr": 2e-4}
    assert [r.overrides for r in sw.runs] == [{"sft.lr": 1e-3}, {"sft.lr": 0.01}]
    assert C.load(BASE, _sets(S.command(sw, sw.runs[0], "/x"))).sft.lr == 1e-3


def test_metric_stats_by_hand(tmp_path):
    rows = [
        {"step": 0, "version": 0, "time": 0.0, "eval/accuracy": 0.25},
        {"step": 1, "version": 1, "time": 1.0, "reward/mean": 0.5, "throughput/tokens_per_s": 100},
        {"step": 2, "version": 2, "time": 2.0, "reward/mean": 0.3, "throughput/tokens_per_s": 300},
        {"step": 3, "version": 3, "time": 3.0, "eval/accuracy": 0.75, "reward/mean": 0.4},
        {"step": 4, "version": 4, "time": 4.0, "eval/accuracy": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = S.metric_stats(str(tmp_path), ["eval/accuracy", "reward/mean", "loss/kl"])
    assert got == {
        "eval/accuracy:final": 0.5,
        "eval/accuracy:best": 0.75,
        "reward/mean:final": 0.4,
        "reward/mean:best": 0.5,
        "loss/kl:final": None,
        "loss/kl:best": None,
        "tokens_per_s": 200.0,
    }


# --- a real sweep ----------------------------------------------------------------------------


def _read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _final_and_best(run_dir, metric: str) -> tuple[float, float]:
    """Independent reading of metrics.jsonl: last logged value and the max."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        vals = [json.loads(line).get(metric) for line in f if line.strip()]
    vals = [v for v in vals if v is not None]
    return vals[-1], max(vals)


@pytest.mark.slow
def test_smoke_sweep_end_to_end(tmp_path, capsys):
    """The smoke runs plus one broken run; then the smoke sweep again runs nothing."""
    out = tmp_path / "out"
    with open(SMOKE) as f:
        data = yaml.safe_load(f)
    data["name"] = "smoke"  # same run names as smoke.yaml, so its DONE markers apply below
    data["base"] = BASE
    data["runs"] = [{"name": "broken", "trainer.mode": "bogus"}, *data["runs"]]
    path = _write(tmp_path, data, "smoke_plus_broken.yaml")

    assert S.main(["--config", path, "--out", str(out), "--parallel", "2"]) == 1
    printed = capsys.readouterr().out
    assert "ran 3, skipped 0, failed 1" in printed
    rows = {r["run"]: r for r in _read_csv(out / "results.csv")}
    assert list(rows) == ["broken_seed-0", "sync_seed-0", "async_seed-0"]

    broken, broken_dir = rows["broken_seed-0"], out / "broken_seed-0"
    assert broken["status"] == "failed"
    assert "trainer.mode: invalid value 'bogus'" in broken["error"]
    assert (broken_dir / "FAILED").exists() and not (broken_dir / "DONE").exists()
    assert json.loads((broken_dir / "FAILED").read_text())["returncode"] == 2

    for name, mode in [("sync_seed-0", "sync"), ("async_seed-0", "async")]:
        row, run_dir = rows[name], out / name
        assert row["status"] == "ok" and row["error"] == ""
        assert row["trainer.mode"] == mode and row["seed"] == "0"
        for metric in ("eval/accuracy", "reward/mean", "loss/entropy"):
            final, best = _final_and_best(run_dir, metric)
            assert float(row[f"{metric}:final"]) == pytest.approx(final, rel=1e-12)
            assert float(row[f"{metric}:best"]) == pytest.approx(best, rel=1e-12)
        assert 0.0 <= float(row["eval/accuracy:final"]) <= 1.0
        assert float(row["wall_s"]) > 1.0 and float(row["tokens_per_s"]) > 0.0
        done = json.loads((run_dir / "DONE").read_text())
        assert done["status"] == "ok" and "eval/accuracy_end" in done["summary"]
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["name"] == f"smoke/{name}" and cfg["trainer"]["mode"] == mode
    assert rows["async_seed-0"]["algorithm.loss"] == "decoupled_ppo"
    md = (out / "results.md").read_text()
    assert "| broken_seed-0 |" in md and "| failed |" in md and "invalid value 'bogus'" in md

    # Again, with the smoke sweep itself: both runs are DONE, nothing runs.
    watched = [out / n / f for n in ("sync_seed-0", "async_seed-0") for f in (S.LOG, "DONE")]
    mtimes = [p.stat().st_mtime_ns for p in watched]
    assert S.main(["--config", SMOKE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ran 0, skipped 2, failed 0" in printed
    assert "skip sync_seed-0 (DONE)" in printed and "start" not in printed
    assert [p.stat().st_mtime_ns for p in watched] == mtimes
    again = {r["run"]: r for r in _read_csv(out / "results.csv")}
    assert list(again) == ["sync_seed-0", "async_seed-0"]
    for name in again:
        assert again[name]["eval/accuracy:final"] == rows[name]["eval/accuracy:final"]
        assert again[name]["wall_s"] == rows[name]["wall_s"]


def test_interrupted_run_is_resumed(tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    assert not S._has_checkpoint(str(run_dir))  # an empty checkpoints dir: start afresh
    (run_dir / "checkpoints" / "0").mkdir()
    assert S._has_checkpoint(str(run_dir))
    sw = S.load(SMOKE)
    assert S.command(sw, sw.runs[0], str(run_dir), resume=True)[-1] == "--resume"
    assert "--resume" not in S.command(sw, sw.runs[0], str(run_dir))


@pytest.mark.slow
def test_smoke_sweep_on_ray(tmp_path, capsys):
    """--ray: each run is a Ray task in a worker process (its pid in the log), results as usual."""
    out = tmp_path / "out"
    code = S.main(
        ["--config", SMOKE, "--out", str(out), "--ray", "--parallel", "2", "--ray-cpus", "1"]
    )
    printed = capsys.readouterr().out
    logs = "".join(f"\n--- {p}\n" + p.read_text()[-3000:] for p in out.glob(f"*/{S.LOG}"))
    assert code == 0, printed + logs
    assert "ran 2, skipped 0, failed 0" in printed
    rows = {r["run"]: r for r in _read_csv(out / "results.csv")}
    assert list(rows) == ["sync_seed-0", "async_seed-0"]
    for name, row in rows.items():
        assert row["status"] == "ok"
        assert 0.0 <= float(row["eval/accuracy:final"]) <= 1.0
        log = (out / name / S.LOG).read_text()
        pids = [int(m) for m in re.findall(r"\[ray task: pid (\d+) on ", log)]
        assert len(pids) == 1 and pids[0] != os.getpid(), log[:400]
        assert json.loads((out / name / "DONE").read_text())["status"] == "ok"
