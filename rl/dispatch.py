"""The one admit -> generate -> deliver loop, for the local and the Ray transports.

A rollout has `slots` (the local transport: `streams` of one engine, which batches their
requests continuously; the Ray transport: one per worker actor). Each slot gets a dispatcher
thread that admits groups from the coordinator (the staleness rule), runs them on its slot and
puts the finished groups into the buffer, so a group is delivered as soon as it is done. A lost
worker's groups go back to the coordinator (same numbers, counted as re-dispatched) and the slot
gets a replacement; any other failure reaches the learner through buffer.fail.

Once the coordinator is stopped (a preemption) a local rollout returns what its groups have:
finished groups still go to the buffer, unfinished ones are kept as PartialGroups (partials())
for the trainer's checkpoint. Generated tokens that reach neither (a lost worker's) are counted
in the buffer's tokens_discarded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from rl.agent import run_groups
from rl.buffer import GroupBuffer
from rl.coordinator import Coordinator
from rl.metrics import BusyClock
from rl.partials import PartialGroup
from rl.rollout.base import SamplingParams, WorkerLost


@runtime_checkable
class RolloutSlots(Protocol):
    """What a Dispatcher needs from a transport (LocalRollout, rl.ray.pool.WorkerPool): `slots`
    dispatcher threads over `engines` independent engines, and per slot a run and a replacement
    (tests/test_engine_contract.py checks both)."""

    slots: int
    engines: int

    def run(self, slot: int, items: list, sampling: SamplingParams, stopped=lambda: False):
        """The groups of items [(group, version, problem, seeds[, saved partial])] run on `slot`:
        [EpisodeGroup | PartialGroup], or None once stopped(); raises WorkerLost if the slot's
        worker is lost."""
        ...

    def replace(self, slot: int, why: str, on_started=None) -> None:
        """Gives `slot` a replacement for a lost worker; on_started() once it is launched (the
        lost groups go back to the coordinator then)."""
        ...


class LocalRollout:
    """The local transport: `streams` slots whose groups run on one engine of this process."""

    engines = 1

    def __init__(self, engine, task, tokenizer, streams: int = 1):
        self.engine, self.task, self.tokenizer = engine, task, tokenizer
        self.slots = streams

    def run(self, slot: int, items: list, sampling: SamplingParams, stopped=lambda: False):
        """The groups of items [(group, version, problem, seeds[, saved partial])]: once
        stopped() is true (the engine was aborted), unfinished ones as PartialGroups."""
        return run_groups(self.engine, self.task, self.tokenizer, items, sampling, halt=stopped)

    def replace(self, slot: int, why: str, on_started=None) -> None:
        """The engine replaces a lost process itself (ProcessEngine, within
        trainer.max_rollout_restarts; past it the engine's next call fails the run): the lost
        groups go back to the coordinator."""
        if on_started is not None:
            on_started()


class Dispatcher:
    """One thread per rollout slot: admit groups, run them, deliver them to the buffer.

    `work(admitted)` turns [(group, version)] into [(group, version, problem, seeds)].
    """

    def __init__(
        self,
        rollout: RolloutSlots,
        coord: Coordinator,
        buffer: GroupBuffer,
        work: Callable[[list], list],
        sampling: SamplingParams,
        *,
        max_groups: int,
        deadline_s: float,
    ):
        self.rollout, self.coord, self.buffer = rollout, coord, buffer
        self.work, self.sampling = work, sampling
        self.max_groups, self.deadline_s = max_groups, deadline_s
        self.clocks = [BusyClock() for _ in range(rollout.engines)]  # busy time per engine
        self._partials: dict[int, PartialGroup] = {}  # unfinished groups of a stopped rollout
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"rollout-{i}", daemon=True)
            for i in range(rollout.slots)
        ]

    def start(self) -> None:
        """Starts the dispatcher threads."""
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds in all for the threads to end (after coord.stop() and
        the rollout's abort()); True if they all did."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def partials(self) -> dict[int, PartialGroup]:
        """{group: PartialGroup} of the groups a stopped rollout returned unfinished."""
        with self._lock:
            return dict(self._partials)

    def busy_s(self) -> float:
        """Seconds an engine spent running groups, averaged over the engines."""
        return sum(c.busy_s() for c in self.clocks) / len(self.clocks)

    def tokens(self) -> int:
        """Generated tokens delivered so far."""
        return sum(c.tokens for c in self.clocks)

    def _loop(self, slot: int) -> None:
        coord, clock = self.coord, self.clocks[slot % len(self.clocks)]
        try:
            while True:
                admitted = coord.admit(self.max_groups, timeout=self.deadline_s)
                if not admitted:
                    return
                try:
                    with clock.busy():
                        groups = self.rollout.run(
                            slot, self.work(admitted), self.sampling, lambda: coord.stopped
                        )
                except WorkerLost as e:
                    self.buffer.discard(getattr(e, "tokens_generated", 0))
                    if coord.stopped:
                        return
                    lost = [g for g, _ in admitted]
                    self.rollout.replace(
                        slot, str(e), on_started=lambda lost=lost: coord.requeue(lost)
                    )
                    continue
                if groups is None:
                    return
                done = [g for g in groups if not isinstance(g, PartialGroup)]
                with self._lock:
                    self._partials.update(
                        (g.group_id, g) for g in groups if isinstance(g, PartialGroup)
                    )
                clock.add_tokens(sum(e.num_generated for g in done for e in g.episodes))
                for g in done:  # delivered even once stopped: a preemption checkpoints them
                    self.buffer.put(g)
                if coord.stopped:
                    return
        except BaseException as e:  # noqa: BLE001 - the learner must hear of any failure
            self.buffer.fail(e)
