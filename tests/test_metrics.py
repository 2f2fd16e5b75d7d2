"""metrics.jsonl format, resume, tensorboard events, the busy clock, progress output."""

import io
import json
import math
import struct

import numpy as np
import pytest

from rl import metrics as M


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def strict_rows(path):
    """Parse JSONL refusing NaN/Infinity tokens (they are not valid JSON)."""

    def bad(token):
        raise AssertionError(f"non-JSON constant {token} in {path}")

    return [json.loads(line, parse_constant=bad) for line in path.read_text().splitlines()]


def tb_events(run_dir):
    """Decode every Event record of every tfevents file (TFRecord framing, parsed by hand)."""
    from tensorboardX.proto import event_pb2

    events = []
    for f in sorted(run_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12 : i + 12 + n])
            events.append(ev)
            i += 12 + n + 4
    return events


def make_writer(tmp_path, clock, **kw):
    kw.setdefault("tensorboard", False)
    kw.setdefault("progress", False)
    kw.setdefault("stream", io.StringIO())
    return M.MetricsWriter(tmp_path, clock=clock, **kw)


def test_jsonl_lines_keys_types_and_flush(tmp_path):
    clock = FakeClock()
    w = make_writer(tmp_path, clock)
    clock.t += 1.5
    w.log(0, 0, {"reward/mean": np.float32(0.25), "eval/accuracy": 0.5, "count/groups": 4})
    # Flushed per line: readable while the writer is still open.
    assert strict_rows(tmp_path / "metrics.jsonl") == [
        {"step": 0, "version": 0, "time": 1.5, "reward/mean": 0.25, "eval/accuracy": 0.5,
         "count/groups": 4}
    ]  # fmt: skip
    clock.t += 2.0
    w.log(1, 1, {"reward/mean": 0.75, "count/groups": np.int64(7), "flag/on": np.bool_(True)})
    w.close()
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert list(rows[1]) == ["step", "version", "time", "reward/mean", "count/groups", "flag/on"]
    assert rows[1]["time"] == 3.5
    assert type(rows[1]["count/groups"]) is int and rows[1]["count/groups"] == 7
    assert rows[1]["flag/on"] == 1


def test_jax_scalars_including_bfloat16(tmp_path):
    import jax.numpy as jnp

    w = make_writer(tmp_path, FakeClock())
    w.log(0, 0, {"a/bf16": jnp.asarray(1.5, jnp.bfloat16), "a/f32": jnp.float32(0.25),
                 "a/i32": jnp.asarray(3), "a/nan": jnp.asarray(jnp.nan, jnp.bfloat16)})  # fmt: skip
    w.close()
    (row,) = strict_rows(tmp_path / "metrics.jsonl")
    assert row["a/bf16"] == 1.5 and row["a/f32"] == 0.25 and row["a/nan"] is None
    assert row["a/i32"] == 3 and type(row["a/i32"]) is int


def test_missing_tensorboardx_falls_back_to_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorboardX", None)  # import fails
    with pytest.warns(UserWarning, match="tensorboardX is not installed"):
        w = make_writer(tmp_path, FakeClock(), tensorboard=True)
    w.log(0, 0, {"reward/mean": 1.0})
    w.log_histogram(0, "staleness/tokens", [0, 1])
    w.close()
    assert strict_rows(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 1.0
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_nonfinite_values_are_null(tmp_path):
    w = make_writer(tmp_path, FakeClock())
    w.log(3, 2, {"a/nan": float("nan"), "a/inf": np.inf, "a/ninf": np.float64(-np.inf),
                 "a/none": None, "a/ok": 1.0})  # fmt: skip
    w.close()
    (row,) = strict_rows(tmp_path / "metrics.jsonl")
    assert row["a/nan"] is None and row["a/inf"] is None and row["a/ninf"] is None
    assert row["a/none"] is None and row["a/ok"] == 1.0


@pytest.mark.parametrize(
    "metrics, match",
    [
        ({"loss": 1.0}, "namespaced"),
        ({"reward/": 1.0}, "namespaced"),
        ({"reward/mean": "high"}, "expected int or float"),
        ({"reward/mean": np.ones(3)}, "shape"),
    ],
)
def test_bad_metrics_are_rejected_with_the_key(tmp_path, metrics, match):
    w = make_writer(tmp_path, FakeClock())
    with pytest.raises((ValueError, TypeError), match=match):
        w.log(0, 0, metrics)
    w.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resume_truncates_later_steps_and_time_stays_monotone(tmp_path):
    clock = FakeClock()
    w = make_writer(tmp_path, clock)
    for step in range(6):
        clock.t += 10.0
        w.log(step, step, {"reward/mean": step / 10})
    w.close()
    # A crash tore the last line mid-write.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "vers')

    clock2 = FakeClock(5.0)  # a new process: its clock has nothing to do with the old one
    w = make_writer(tmp_path, clock2, resume=3)
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["time"] == 40.0
    clock2.t += 2.0
    w.log(4, 4, {"reward/mean": 0.4})
    w.close()
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["time"] == 42.0
    times = [r["time"] for r in rows]
    assert times == sorted(times)


def test_resume_purges_later_tensorboard_steps(tmp_path):
    from tensorboardX.proto import event_pb2

    w = make_writer(tmp_path, FakeClock(), tensorboard=True)
    for step in range(6):
        w.log(step, step, {"reward/mean": 1.0})
    w.close()
    w = make_writer(tmp_path, FakeClock(), tensorboard=True, resume=3)
    w.log(4, 4, {"reward/mean": 2.0})
    w.close()
    events = tb_events(tmp_path)
    starts = [(ev.step, ev.session_log.status) for ev in events if ev.HasField("session_log")]
    # TensorBoard drops earlier events with step >= a START event's step (the crashed tail).
    assert starts == [(4, event_pb2.SessionLog.START)]
    # Both sessions' files survive (written within the same second, yet not overwritten).
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    steps = sorted(ev.step for ev in events for v in ev.summary.value if v.tag == "reward/mean")
    assert steps == [0, 1, 2, 3, 4, 4, 5]


def test_resume_true_appends_and_fresh_start_replaces(tmp_path):
    clock = FakeClock()
    w = make_writer(tmp_path, clock)
    clock.t += 3.0
    w.log(0, 0, {"reward/mean": 0.0})
    w.close()
    w = make_writer(tmp_path, FakeClock(0.0), resume=True)
    w.log(1, 1, {"reward/mean": 1.0})
    w.close()
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["time"]) for r in rows] == [(0, 3.0), (1, 3.0)]
    w = make_writer(tmp_path, FakeClock(0.0), resume=False)
    w.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_corrupt_middle_line_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        make_writer(tmp_path, FakeClock(), resume=True)


def test_tensorboard_scalars_and_histogram_written(tmp_path):
    w = make_writer(tmp_path, FakeClock(), tensorboard=True)
    w.log(1, 1, {"reward/mean": 0.5, "x/null": float("nan")})
    w.log(2, 2, {"reward/mean": 0.75})
    w.log_histogram(2, "staleness/tokens", np.array([0, 0, 1, 3]))
    w.close()
    files = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    scalars = {}
    hist = None
    for ev in tb_events(tmp_path):
        for v in ev.summary.value:
            if v.HasField("histo"):
                hist = (ev.step, v.tag, v.histo)
            else:
                scalars[(v.tag, ev.step)] = v.simple_value
    assert scalars[("reward/mean", 1)] == 0.5
    assert scalars[("reward/mean", 2)] == 0.75
    assert scalars[("version", 2)] == 2.0
    assert not any(tag == "x/null" for tag, _ in scalars)  # nulls are not plotted as NaN
    assert hist is not None and hist[0] == 2 and hist[1] == "staleness/tokens"
    assert (hist[2].num, hist[2].min, hist[2].max, hist[2].sum) == (4, 0, 3, 4)


def test_staleness_metrics_hand_computed():
    s = np.array([[0, 0, 0, 1], [1, 2, 3, 9]])
    out = M.staleness_metrics(s)
    # sorted: 0 0 0 1 1 2 3 9 -> mean 16/8; p50 at rank 3.5 -> 1; p90 at rank 6.3 -> 3 + .3*6
    assert out["staleness/mean"] == 2.0
    assert out["staleness/max"] == 9.0
    assert out["staleness/p50"] == 1.0
    assert out["staleness/p90"] == pytest.approx(4.8, abs=1e-12)
    expected = {0: 3 / 8, 1: 2 / 8, 2: 1 / 8, 3: 1 / 8, 4: 0, 5: 0, 6: 0, 7: 0, 8: 0}
    for k, frac in expected.items():
        assert out[f"staleness/frac_{k}"] == frac
    assert out["staleness/frac_gt8"] == 1 / 8


def test_staleness_metrics_mask_empty_and_negative():
    s = np.array([5, 0, 2, 7])
    mask = np.array([0, 1, 1, 0])
    out = M.staleness_metrics(s, mask)
    assert out["staleness/mean"] == 1.0 and out["staleness/max"] == 2.0
    assert out["staleness/frac_0"] == 0.5 and out["staleness/frac_2"] == 0.5
    empty = M.staleness_metrics(np.zeros((2, 0), np.int32))
    assert math.isnan(empty["staleness/mean"]) and math.isnan(empty["staleness/frac_0"])
    with pytest.raises(ValueError, match="negative staleness -1"):
        M.staleness_metrics(np.array([0, -1]))
    with pytest.raises(ValueError, match="whole numbers"):
        M.staleness_metrics(np.array([0.5]))


def test_busy_clock_is_the_union_of_calls():
    clock = FakeClock(0.0)
    busy = M.BusyClock(clock=clock)
    busy.enter()  # call A: 0..3
    clock.t = 1.0
    busy.enter()  # call B: 1..5 overlaps A
    clock.t = 3.0
    busy.exit(tokens=10)
    assert busy.busy_s() == 3.0  # a call in progress counts up to now
    clock.t = 5.0
    busy.exit(tokens=5)
    clock.t = 8.0
    with busy.busy():  # 8..9
        clock.t = 9.0
    busy.add_tokens(2)
    snap = busy.snapshot()
    assert snap == {"busy_s": 6.0, "generate_calls": 3, "tokens": 17, "generating": 0}


def test_engine_metrics_keep_their_names():
    stats = {"busy_s": 1.0, "workers": 2, "restarts": 1, "batches": 7, "batch_mbytes": 0.5}
    assert M.engine_metrics(stats) == {
        "rollout/workers": 2.0,
        "rollout/restarts": 1.0,
        "transport/batches": 7.0,
        "transport/batch_mbytes": 0.5,
    }


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_tty(tmp_path):
    clock = FakeClock(0.0)
    out = FakeTTY()
    w = M.MetricsWriter(tmp_path, tensorboard=False, total_updates=4, stream=out, clock=clock)
    for step in range(5):
        w.log(step, step, {"reward/mean": 0.1 * step, "throughput/tokens_per_s": 1500.0})
        if step == 2:
            w.log(step, step, {"eval/accuracy": 0.625})
        clock.t += 30.0
    w.close()
    text = out.getvalue()
    assert "\r" in text and text.endswith("\n")
    # At update 2, 60 s for 2 updates -> 2 updates left take 60 s.
    assert "update 2/4 | reward 0.200 | eval - | tok/s 1500 | 1m00s elapsed | eta 1m00s" in text
    assert "update 3/4 | reward 0.300 | eval 0.625" in text


def test_progress_off_prints_compact_lines(tmp_path):
    out = io.StringIO()  # not a TTY
    w = M.MetricsWriter(
        tmp_path, tensorboard=False, total_updates=10, print_every=5, stream=out,
        clock=FakeClock(),
    )  # fmt: skip
    for step in range(11):
        w.log(step, step, {"reward/mean": 1.0})
    w.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        "[tandem] update 0/10", "[tandem] update 5/10", "[tandem] update 10/10"
    ]  # fmt: skip
    assert "\r" not in out.getvalue()
