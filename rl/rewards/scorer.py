"""Scores completions with a weighted sum of rewards, in the caller's thread or in worker
processes that enforce a time limit and survive rewards that hang or crash."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Sequence

from rl.rewards.builtin import final_answer
from rl.rewards.registry import (
    BoundReward,
    RewardSpecError,
    Sample,
    call_safely,
    import_modules,
    resolve_specs,
)
from rl.tasks.base import RewardResult

# How long a new worker may take to import its modules and resolve the specs.
START_TIMEOUT_S = 120.0
STATS = ("reward/errors", "reward/timeouts", "reward/calls")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One reward function's result for one completion: its score, or the fault that zeroed it."""

    value: float
    error: str = ""  # traceback or reason when the function failed
    timed_out: bool = False


def serve(conn, specs, imports: Sequence[str], where: str) -> None:
    """A worker process: resolves the specs, then scores (completion, sample) messages."""
    # The parent owns shutdown: a preemption's SIGTERM to the process group (`timeout`, SLURM)
    # must not kill workers while the run checkpoints; an orphan exits on the pipe's EOF.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import_modules(imports, where)
        rewards = resolve_specs(specs, where)
    except RewardSpecError as e:
        conn.send(("failed", str(e)))
        return
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", ""))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message is None:
            return
        completion, sample = message
        try:
            for reward in rewards:
                conn.send(call_safely(reward, completion, sample))
        except OSError:  # the parent closed the pipe: it is stopping or gave up on this call
            return


@dataclasses.dataclass(eq=False)
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection


class _Pool:
    """Worker processes shared by caller threads; a worker that overruns or dies is replaced."""

    def __init__(self, size: int, specs, imports: Sequence[str], where: str, wait_s: float):
        self._context = multiprocessing.get_context("spawn")
        self._target = (specs, tuple(imports), where)
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()  # idle or busy
        self._starting = 0  # replacements not ready yet
        self._closed = False
        self._restart_error = ""
        workers: list[_Worker] = []
        try:
            for _ in range(size):  # start all, then wait for each
                workers.append(self._spawn())
            for worker in workers:
                self._await_ready(worker)
        except BaseException:
            for worker in workers:
                _stop(worker)
            raise
        with self._cond:
            self._live.update(workers)
            self._idle.extend(workers)

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=serve, args=(child, *self._target), name="reward-worker", daemon=True
        )
        process.start()
        child.close()
        return _Worker(process, parent)

    def _await_ready(self, worker: _Worker) -> None:
        where = self._target[2]
        try:
            if not worker.conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"{where}: a reward worker did not start in {START_TIMEOUT_S} s")
            status, detail = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(5.0)
            raise RuntimeError(
                f"{where}: a reward worker exited (code {worker.process.exitcode}) while "
                "starting; its traceback is on stderr"
            ) from None
        if status != "ready":
            raise RewardSpecError(f"{detail} (in a reward worker process)")

    def _restart(self) -> None:
        worker = None
        try:
            worker = self._spawn()
            self._await_ready(worker)
        except Exception as e:
            if worker is not None:
                _stop(worker)
            print(f"reward worker restart failed: {e}", file=sys.stderr, flush=True)
            with self._cond:
                self._starting -= 1
                self._restart_error = str(e)
                self._cond.notify_all()
            return
        with self._cond:
            self._starting -= 1
            if self._closed:
                _stop(worker)
                return
            self._live.add(worker)
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, worker: _Worker) -> None:
        """Kills a worker that overran or died and starts a fresh one in the background."""
        _stop(worker)
        with self._cond:
            self._live.discard(worker)
            if self._closed:
                return
            self._starting += 1
        threading.Thread(target=self._restart, name="reward-worker-start", daemon=True).start()

    def _acquire(self, deadline: float) -> _Worker | None:
        with self._cond:
            while not self._idle:
                if self._closed:
                    raise RuntimeError("the reward scorer is closed")
                if not self._live and not self._starting:
                    raise RuntimeError(f"no reward worker is left: {self._restart_error}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._idle.pop()

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                return
            self._idle.append(worker)
            self._cond.notify()

    def run(self, payload: bytes, count: int, timeout_s: float) -> list[Outcome]:
        """The outcomes of one call (count reward functions) on a free worker."""
        worker = self._acquire(time.monotonic() + self.wait_s)
        if worker is None:
            reason = f"no reward worker was free within wait_s={self.wait_s} s"
            return [Outcome(0.0, reason, timed_out=True)] + [Outcome(0.0)] * (count - 1)
        deadline = time.monotonic() + timeout_s
        outcomes: list[Outcome] = []
        try:
            worker.conn.send_bytes(payload)
            for _ in range(count):
                if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                    self._replace(worker)
                    reason = f"ran past timeout_s={timeout_s} s; its worker was killed and replaced"
                    outcomes.append(Outcome(0.0, reason, timed_out=True))
                    break
                value, error = worker.conn.recv()
                outcomes.append(Outcome(value, error))
            else:
                self._release(worker)
        except (EOFError, OSError):
            self._replace(worker)
            reason = f"its worker died (exit code {worker.process.exitcode}) and was replaced"
            outcomes.append(Outcome(0.0, reason))
        return outcomes + [Outcome(0.0)] * (count - len(outcomes))

    def close(self) -> None:
        """Stops every worker; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            workers = list(self._live)
            self._live.clear()
            self._idle.clear()
            self._cond.notify_all()
        for worker in workers:  # ask all to stop first, then wait for each
            try:
                worker.conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        for worker in workers:
            worker.process.join(1.0)
            _stop(worker)


def _stop(worker: _Worker) -> None:
    """Kills the worker's process if it still runs and closes its pipe."""
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(5.0)
    worker.conn.close()


class Scorer:
    """Scores completions with the weighted sum of a reward spec's functions; see make_scorer."""

    def __init__(self, rewards: list[BoundReward], timeout_s: float, pool: _Pool | None):
        self.rewards = rewards
        self.timeout_s = timeout_s
        self._pool = pool
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STATS, 0)
        self._printed: set[str] = set()
        self._close = weakref.finalize(self, pool.close) if pool is not None else None

    def score(self, completion: str, sample: Sample) -> RewardResult:
        """Weighted-sum reward, correct (first reward >= 1.0) and formatted of one completion."""
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        if self._pool is None:
            outcomes = [Outcome(*call_safely(r, completion, sample)) for r in self.rewards]
        else:
            outcomes = self._run_in_pool(completion, sample)
        self._count(outcomes)
        reward = sum(r.weight * o.value for r, o in zip(self.rewards, outcomes))
        correct = outcomes[0].value >= 1.0
        formatted = correct or final_answer(completion) is not None
        return RewardResult(reward=float(reward), correct=correct, formatted=formatted)

    def _run_in_pool(self, completion: str, sample: Sample) -> list[Outcome]:
        try:
            payload = pickle.dumps((completion, sample), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            error = "the sample cannot be sent to a worker:\n" + traceback.format_exc()
            return [Outcome(0.0, error)] + [Outcome(0.0)] * (len(self.rewards) - 1)
        return self._pool.run(payload, len(self.rewards), self.timeout_s)

    def _count(self, outcomes: list[Outcome]) -> None:
        with self._lock:
            self._counts["reward/calls"] += 1
            for reward, outcome in zip(self.rewards, outcomes):
                if not outcome.error:
                    continue
                kind = "reward/timeouts" if outcome.timed_out else "reward/errors"
                self._counts[kind] += 1
                if kind not in self._printed:
                    self._printed.add(kind)
                    print(
                        f"reward {reward.label!r} scored 0: {outcome.error.rstrip()}\n(later "
                        f"ones are counted in {kind}, not printed)",
                        file=sys.stderr,
                        flush=True,
                    )

    def stats(self) -> dict[str, float]:
        """Cumulative counts: reward/errors, reward/timeouts, reward/calls (completions scored)."""
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}

    def close(self) -> None:
        """Stops the worker processes; idempotent (it also runs at interpreter exit)."""
        if self._close is not None:
            self._close()


def make_scorer(
    specs,
    timeout_s: float = 10.0,
    workers: int = 1,
    imports: Sequence[str] = (),
    where: str = "rewards",
    wait_s: float | None = None,
) -> Scorer:
    """A Scorer of the reward specs; RewardSpecError naming where[i] for a bad one.

    `specs`: a list of reward names, or mappings {name | function: 'package.module:function',
    weight (1.0), args ({}: keyword arguments bound to the function)}. The reward is the
    weighted sum; `correct` is the FIRST listed reward's own value >= 1.0; `formatted` is
    whether the completion has a final answer (final_answer), or is correct.
    `imports`: modules to import first (they may register rewards), here and in each worker.
    `workers=0`: rewards run in the caller's thread; no time limit can be enforced there, so
    a slow reward blocks its caller and nothing counts as a timeout.
    `workers>=1`: that many spawned worker processes, shared by caller threads; one message
    per completion. A call that runs past `timeout_s` (all of its functions together) has its
    worker killed and replaced: the function in flight scores 0 and counts as a timeout, the
    ones after it score 0 uncounted. A worker that dies counts as an error and is replaced.
    Waiting for a free worker is limited to `wait_s` (default max(60, 10 * timeout_s)), then
    the call scores 0 as a timeout. A reward that raises or returns no finite number scores 0
    and counts as an error. The first error and the first timeout are printed to stderr.
    `score` raises RuntimeError after `close`, or when no worker is left (restarts failed).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise RewardSpecError(f"{where}: workers: invalid value {workers!r}; expected an int >= 0")
    for key, value in (("timeout_s", timeout_s), ("wait_s", wait_s)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (value is not None or key == "timeout_s") and not (number and value > 0):
            raise RewardSpecError(f"{where}: {key}: invalid value {value!r}; must be > 0")
    if isinstance(imports, str):
        imports = (imports,)
    import_modules(imports, where)
    rewards = resolve_specs(specs, where, prepare=workers == 0)
    pool = None
    if workers:
        wait_s = max(60.0, 10.0 * timeout_s) if wait_s is None else wait_s
        pool = _Pool(workers, list(specs), imports, where, wait_s)
    return Scorer(rewards, float(timeout_s), pool)
