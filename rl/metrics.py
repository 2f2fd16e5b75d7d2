"""Metrics: staleness aggregation, the busy clock, per-update rows, the metrics.jsonl +
tensorboardX writer and console progress.

`runs/<name>/metrics.jsonl` holds one JSON object per line, always with `step` (optimizer
updates applied), `version` (policy version) and `time` (seconds since the run started,
monotone across resumes), plus metrics whose names are namespaced with `/`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

METRICS_FILE = "metrics.jsonl"
RESERVED_KEYS = ("step", "version", "time")
MAX_STALENESS_BIN = 8  # staleness/frac_0 .. frac_8, plus frac_gt8

# Metric names the progress bar, the analysis plots and the trainer agree on.
REWARD = "reward/mean"
EVAL_ACCURACY = "eval/accuracy"
TOKENS_PER_S = "throughput/tokens_per_s"
WEIGHT_SYNC = "timing/weight_sync"
IDLE_LEARNER = "idle/learner"
IDLE_ROLLOUT = "idle/rollout"


# ---------------------------------------------------------------------------------------------
# Aggregation


def _finite_1d(values: Any) -> np.ndarray:
    """Values flattened to float64 with non-finite entries removed."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    return x[np.isfinite(x)]


def staleness_metrics(token_staleness: Any, mask: Any = None) -> dict[str, float]:
    """Per-token staleness (versions) -> mean, max, p50, p90 and fractions at 0..8 and >8.

    `token_staleness` is integer staleness per trained token (any shape); `mask` (same shape,
    optional) selects the trained tokens. Fractions `staleness/frac_k` sum to 1 together with
    `staleness/frac_gt8`. With no tokens every value is NaN (logged as null).
    """
    s = np.asarray(token_staleness)
    if mask is not None:
        m = np.asarray(mask)
        if m.shape != s.shape:
            raise ValueError(f"mask shape {m.shape} != token_staleness shape {s.shape}")
        s = s[m.astype(bool)]
    s = s.reshape(-1)
    if s.size and not np.issubdtype(s.dtype, np.integer):
        if not np.all(np.isfinite(s)) or np.any(s != np.round(s)):
            raise ValueError(f"token_staleness must be whole numbers of versions, got {s[:8]}")
    s = s.astype(np.int64)
    keys = [f"staleness/frac_{k}" for k in range(MAX_STALENESS_BIN + 1)]
    keys.append(f"staleness/frac_gt{MAX_STALENESS_BIN}")
    if s.size == 0:
        out = {f"staleness/{k}": math.nan for k in ("mean", "max", "p50", "p90")}
        out.update({k: math.nan for k in keys})
        return out
    if s.min() < 0:
        raise ValueError(
            f"negative staleness {int(s.min())}: a token's version is newer than the update "
            "training it (staleness = v - token_version must be >= 0)"
        )
    counts = np.bincount(np.minimum(s, MAX_STALENESS_BIN + 1), minlength=MAX_STALENESS_BIN + 2)
    out = {
        "staleness/mean": float(s.mean()),
        "staleness/max": float(s.max()),
        "staleness/p50": float(np.percentile(s, 50)),
        "staleness/p90": float(np.percentile(s, 90)),
    }
    out.update({k: float(c) / s.size for k, c in zip(keys, counts)})
    return out


class BusyClock:
    """Wall time during which at least one call runs (the union of intervals), calls, tokens.

    The one busy clock of the project: engines, rollout workers and dispatchers time their
    generate calls with it (`with clock.busy(): ...`, then `clock.add_tokens(n)`).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0
        self.calls = 0
        self.tokens = 0

    def enter(self) -> None:
        """A call starts."""
        with self._lock:
            if self._active == 0:
                self._since = self._clock()
            self._active += 1
            self.calls += 1

    def exit(self, tokens: int = 0) -> None:
        """A call ends, having generated `tokens`."""
        with self._lock:
            self._active -= 1
            self.tokens += int(tokens)
            if self._active == 0:
                self._total += self._clock() - self._since

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Counts the body as busy time (tokens: add_tokens)."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def add_tokens(self, n: int) -> None:
        """Counts `n` generated tokens."""
        with self._lock:
            self.tokens += int(n)

    def busy_s(self) -> float:
        """Busy seconds so far (a call in progress counts up to now)."""
        with self._lock:
            return self._total + (self._clock() - self._since if self._active else 0.0)

    def snapshot(self) -> dict:
        """busy_s, generate_calls, tokens, generating (calls running now)."""
        with self._lock:
            now = self._total + (self._clock() - self._since if self._active else 0.0)
            return {
                "busy_s": now,
                "generate_calls": self.calls,
                "tokens": self.tokens,
                "generating": self._active,
            }


# ---------------------------------------------------------------------------------------------
# JSONL + tensorboard writer


def _to_number(key: str, value: Any) -> float | int | None:
    """A metric value as a JSON number (None for non-finite); numpy/jax scalars unwrapped."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # 0-d / size-1 np or jax arrays
        arr = np.asarray(value)
        if arr.size != 1:
            raise ValueError(f"metric {key!r}: expected a scalar, got array of shape {arr.shape}")
        if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
            return int(arr.reshape(()).item())
        try:
            return _to_number(key, float(arr.reshape(())))  # also bfloat16 and other ml_dtypes
        except (TypeError, ValueError) as e:
            raise TypeError(f"metric {key!r}: expected a number, got dtype {arr.dtype}") from e
    raise TypeError(f"metric {key!r}: expected int or float, got {type(value).__name__} {value!r}")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parse a metrics.jsonl file; a torn (unparseable) last line is ignored."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break  # a line torn by a crash mid-write
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e}): {line[:200]!r}") from e
    return out


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _fmt_value(v: float | None, spec: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


class MetricsWriter:
    """Writes metrics.jsonl (one flushed line per `log`), tensorboardX scalars and progress.

    `resume`: False starts a fresh file (an existing one is replaced); True appends after the
    existing lines; an int `s` (the step of the restored checkpoint) drops every line with
    step > s first. On resume `time` continues from the last kept line. The console shows a
    progress bar when `progress` is on and stderr is a TTY, else one compact line every
    `print_every` updates (None: about 20 lines per run; 0: silent).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        total_updates: int | None = None,
        resume: bool | int = False,
        print_every: int | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.total_updates = total_updates
        self._clock = clock
        self._lock = threading.Lock()
        self._stream = stream if stream is not None else sys.stderr

        resume_step = self._prepare_file(resume)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter  # lazy: not installed everywhere
            except ImportError:
                warnings.warn(
                    "tensorboardX is not installed: writing metrics.jsonl only "
                    "(pip install tensorboardX, or set logging.tensorboard=false)",
                    stacklevel=2,
                )
            else:
                # purge_step: TensorBoard hides events a crashed run wrote after the resumed step.
                purge = resume_step + 1 if resume_step is not None else None
                # A unique suffix: tensorboardX names files by the second, and a quick
                # crash-and-resume must not overwrite the previous session's events.
                self._tb = SummaryWriter(
                    logdir=str(self.run_dir),
                    purge_step=purge,
                    flush_secs=10,
                    filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}",
                )

        isatty = getattr(self._stream, "isatty", None)
        self._bar = bool(progress and isatty is not None and isatty())
        if print_every is None:
            print_every = max(1, (total_updates or 200) // 20)
        if print_every < 0:
            raise ValueError(f"print_every={print_every}: must be >= 0 (0 = no console lines)")
        self._print_every = print_every
        self._first_step: int | None = None
        self._last: dict[str, float] = {}
        self._bar_open = False
        self._closed = False
        self._start = clock()  # after the tensorboardX import, which alone can take a second

    def _prepare_file(self, resume: bool | int) -> int | None:
        """Apply the resume policy to an existing file; set the time offset. Returns step cut."""
        self._time_offset = 0.0
        if resume is False or not self.path.exists():
            if resume is False and self.path.exists():
                self.path.unlink()
            return None if isinstance(resume, bool) else int(resume)
        rows = read_metrics(self.path)
        cut = None
        if not isinstance(resume, bool):
            cut = int(resume)
            if cut < 0:
                raise ValueError(f"resume={resume}: a resumed step must be >= 0")
            rows = [r for r in rows if r["step"] <= cut]
        self._rewrite(rows)  # keeps the kept lines exactly and removes a torn last line
        if rows:
            self._time_offset = max(float(r.get("time") or 0.0) for r in rows)
        return cut

    def rewind(self, step: int) -> None:
        """Drops every line with step > `step` (the run went back to a checkpoint and logs
        those steps again); time keeps running."""
        with self._lock:
            self._file.close()
            self._rewrite([r for r in read_metrics(self.path) if r["step"] <= step])
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _rewrite(self, rows: list[dict]) -> None:
        """Replaces metrics.jsonl by `rows`, atomically (temp file, fsync, rename)."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def elapsed(self) -> float:
        """Seconds since the run started (continuing across resumes)."""
        return self._time_offset + (self._clock() - self._start)

    def log(self, step: int, version: int, metrics: Mapping[str, Any]) -> None:
        """Append one line {step, version, time, **metrics}; flush; mirror to tensorboard."""
        row: dict[str, Any] = {"step": int(step), "version": int(version)}
        values: dict[str, float | int | None] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or "/" not in key.strip("/"):
                raise ValueError(
                    f"metric name {key!r} must be namespaced with '/' (e.g. 'reward/mean')"
                )
            if key in RESERVED_KEYS:
                raise ValueError(f"metric name {key!r} is reserved ({RESERVED_KEYS})")
            values[key] = _to_number(key, value)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"MetricsWriter for {self.run_dir} is closed")
            row["time"] = round(self.elapsed(), 6)
            row.update(values)
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
            if self._tb is not None:
                for key, v in values.items():
                    if v is not None:
                        self._tb.add_scalar(key, v, global_step=row["step"])
                self._tb.add_scalar("version", row["version"], global_step=row["step"])
            self._progress(row)

    def log_histogram(self, step: int, name: str, values: Any) -> None:
        """Write a tensorboard histogram (e.g. per-token staleness); no-op without tensorboard."""
        if self._tb is None:
            return
        x = _finite_1d(values)
        if x.size == 0:
            return
        with self._lock:
            self._tb.add_histogram(name, x, global_step=int(step))

    # -- console ------------------------------------------------------------------------------

    def _progress(self, row: dict[str, Any]) -> None:
        for key in (REWARD, EVAL_ACCURACY, TOKENS_PER_S):
            if row.get(key) is not None:
                self._last[key] = row[key]
        step = row["step"]
        if self._first_step is None:
            self._first_step = step
            self._first_time = row["time"]
        if self._bar:
            self._stream.write("\r\x1b[2K" + self._status_line(step, row["time"], bar=True))
            self._bar_open = True
            if self.total_updates is not None and step >= self.total_updates:
                self._stream.write("\n")
                self._bar_open = False
            self._stream.flush()
        elif self._print_every and (
            step % self._print_every == 0
            or (self.total_updates is not None and step >= self.total_updates)
        ):
            self._stream.write("[tandem] " + self._status_line(step, row["time"]) + "\n")
            self._stream.flush()

    def _status_line(self, step: int, now: float, bar: bool = False) -> str:
        n = self.total_updates
        done = step - self._first_step
        rate = done / (now - self._first_time) if done > 0 and now > self._first_time else 0.0
        eta = (n - step) / rate if n is not None and rate > 0 else math.nan
        head = f"update {step}/{n}" if n is not None else f"update {step}"
        if n and bar:
            frac = min(1.0, max(0.0, step / n))
            filled = int(round(20 * frac))
            head = f"[{'#' * filled}{'.' * (20 - filled)}] " + head
        return (
            f"{head} | reward {_fmt_value(self._last.get(REWARD), '.3f')}"
            f" | eval {_fmt_value(self._last.get(EVAL_ACCURACY), '.3f')}"
            f" | tok/s {_fmt_value(self._last.get(TOKENS_PER_S), '.4g')}"
            f" | {_fmt_duration(now)} elapsed | eta {_fmt_duration(eta)}"
        )

    def close(self) -> None:
        """Flush and close the JSONL file and the tensorboard writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar_open:
                self._stream.write("\n")
                self._stream.flush()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self._tb is not None:
                self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The trainer's per-update row and episode dumps


def update_row(groups, batch, met: dict, version: int) -> tuple[dict, np.ndarray]:
    """The metrics of one update on `groups` (its batch, the learner's metrics) and the
    staleness of every trained token (version - token version), for the histogram."""
    eps = [e for g in groups for e in g.episodes]
    stale = (version - batch.versions)[batch.loss_mask > 0]
    spans = [e.version_span for e in eps]
    row = {f"loss/{k}": v for k, v in met.items() if not k.startswith("timing/")}
    row.update(
        {
            "reward/mean": float(np.mean([e.reward for e in eps])),
            "reward/correct": float(np.mean([e.correct for e in eps])),
            "reward/formatted": float(np.mean([e.formatted for e in eps])),
            "episode/length": float(np.mean([e.num_generated for e in eps])),
            "episode/turns": float(np.mean([e.num_turns for e in eps])),
            "batch/rows": float(batch.inputs.shape[0]),
            "batch/padding": 1.0 - float(np.mean(batch.segment_ids > 0)),
            "partial/ratio": float(np.mean([s[1] > s[0] for s in spans])),
            "partial/version_span": float(np.mean([s[1] - s[0] for s in spans])),
            "timing/train_step": met["timing/train_step"],
        }
    )
    row.update(staleness_metrics(stale))
    return row, stale


class LoopMeter:
    """Each update's wall-clock figures: its time, learner and rollout idle ratios, tokens/s.

    busy_s() and tokens() are the rollout's cumulative busy seconds and delivered tokens.
    """

    def __init__(self, busy_s: Callable[[], float], tokens: Callable[[], int]):
        self.busy_s, self.tokens = busy_s, tokens
        self.last = (time.perf_counter(), 0, 0.0)

    def row(self, wait_s: float, sync_s: float) -> dict[str, float]:
        """The figures since the previous row (the learner waited wait_s for its data)."""
        now, (then, tokens0, busy0) = time.perf_counter(), self.last
        dt = max(now - then, 1e-9)
        busy, tokens = self.busy_s(), self.tokens()
        self.last = (now, tokens, busy)
        return {
            "timing/wait_data": wait_s,
            "timing/weight_sync": sync_s,
            "timing/update": now - then,
            "idle/learner": wait_s / dt,
            "idle/rollout": max(0.0, 1.0 - (busy - busy0) / dt),
            "throughput/tokens_per_s": (tokens - tokens0) / dt,
        }


# Engine counters logged each update, under the names the metrics always had.
ENGINE_METRICS = {
    "workers": "rollout/workers",
    "restarts": "rollout/restarts",
    "workers_lost": "rollout/workers_lost",
    "batches": "transport/batches",
    "batch_mbytes": "transport/batch_mbytes",
    "updates": "rollout/weight_updates",
    "streamed": "rollout/weight_updates_streamed",
    "traces": "rollout/compilations",
    "warm_traces": "rollout/compilations_warm",
    "slot_occupancy": "rollout/slot_occupancy",
}


def engine_metrics(stats: Mapping[str, Any]) -> dict[str, float]:
    """The engine's stats() counters that the metrics row carries."""
    return {name: float(stats[k]) for k, name in ENGINE_METRICS.items() if k in stats}


def dump_episodes(path: str, groups, tokenizer, limit: int) -> None:
    """The first `limit` episodes of `groups` as JSON lines (for inspection, not for resume)."""
    eps = [(g.group_id, i, e) for g in groups for i, e in enumerate(g.episodes)][:limit]
    with open(path, "w") as f:
        for gid, i, e in eps:
            row = {
                "group": gid,
                "index": i,
                "problem_id": e.problem_id,
                "prompt": tokenizer.decode(e.tokens[: e.prompt_len].tolist()),
                "completion": e.completion_text,
                "reward": e.reward,
                "versions": list(e.version_span),
                "finish_reason": e.finish_reason,
                # every token with its behaviour log-prob and version (-1: not generated)
                "token_ids": e.tokens.tolist(),
                "behavior_logp": e.behavior_logp.tolist(),
                "token_versions": e.versions.tolist(),
            }
            f.write(json.dumps(row) + "\n")


def set_aside_dumps(episodes_dir: str, version: int, restart: int) -> None:
    """The episode dumps of updates after `version` (lost with a learner) move to
    episodes/lost/, named by the restart, so the repeated updates' dumps do not overwrite
    them: a group trained by a lost update and again later stays visible."""
    lost_dir = os.path.join(episodes_dir, "lost")
    for name in sorted(os.listdir(episodes_dir)):
        if name.startswith("v") and name.endswith(".jsonl") and int(name[1:-6]) > version:
            os.makedirs(lost_dir, exist_ok=True)
            os.replace(
                os.path.join(episodes_dir, name), os.path.join(lost_dir, f"restart{restart}-{name}")
            )


def log_preemption(run_dir: str, buffer, partials: dict, *, version, reason, returned) -> None:
    """Appends where every dispatched group is to RUN_DIR/preemptions.jsonl (trained,
    filtered, dropped, lost, buffered, in flight with a saved partial, in flight to start
    again) and says it; groups a rollout did not return in time start again from their
    prompts, and the tokens they had generated are lost: their number is said."""
    acc = buffer.accounting(partials)
    acc.update(
        version=version,
        reason=reason,
        rollout_returned=returned,
        partial_tokens=sum(p.num_generated for p in partials.values()),
    )
    with open(os.path.join(run_dir, "preemptions.jsonl"), "a") as f:
        f.write(json.dumps(acc) + "\n")
    print(
        f"preemption: of {acc['dispatched']} groups dispatched, {acc['trained']} trained, "
        f"{acc['filtered']} filtered, {acc['dropped']} dropped, {acc['lost']} lost, "
        f"{len(acc['buffered'])} finished and kept, {len(acc['partial'])} in flight kept "
        f"({acc['partial_tokens']} tokens), {len(acc['restart'])} to start again",
        file=sys.stderr,
    )
    if not returned:
        print(
            f"preemption: the rollout did not return its groups in time; "
            f"{len(acc['restart'])} groups (numbers {acc['restart'][:16]}) start again from "
            f"their prompts at resume, and the tokens generated for them are lost",
            file=sys.stderr,
        )
