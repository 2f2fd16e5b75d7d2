"""The group buffer: holds finished groups and releases complete ones to the learner.

Only complete groups (all n rollouts) enter. With stale_policy "keep" groups leave strictly in
dispatch order (the order the coordinator's staleness proof needs); with "drop" they leave in
completion order and a group whose oldest token is more than eta versions behind the update is
dropped and counted. Groups whose rewards are all equal have zero advantage under group
baselines: they are filtered (counted) and their slots freed. The bias monitor compares the
trained groups with every finished group (length and reward), so a filter or a drop policy that
skews training toward short or easy episodes shows in the metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import numpy as np

from rl.coordinator import Coordinator, DeadlineError
from rl.types import EpisodeGroup


class Stopped(Exception):
    """The learner's wait for data was ended on purpose (a preemption); nothing was taken."""


class GroupBuffer:
    """Finished groups waiting for the learner."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        stale_policy: str = "keep",
        filter_zero_advantage: bool = True,
        start_group: int = 0,
        max_filtered_factor: int = 4,
    ):
        self.coord = coordinator
        self.stale_policy = stale_policy
        self.filter = filter_zero_advantage
        # At most this many x n_groups groups are filtered per batch; past that, zero-advantage
        # groups are trained (they add no gradient) instead of searching forever.
        self.max_filtered_factor = max_filtered_factor
        self.groups: dict[int, EpisodeGroup] = {}
        # Every group numbered below next_group was consumed (trained, filtered or dropped);
        # `consumed` holds consumed numbers above it ("drop" consumes in completion order; a
        # wait that ended without a batch puts back what it took, not what it filtered).
        self.next_group = start_group
        self.consumed: set[int] = set()
        self.counts = {"filtered": 0, "dropped": 0, "trained": 0, "finished": 0}
        self._finished_stats: list[tuple[float, float]] = []  # (mean length, mean reward)
        self._trained_stats: list[tuple[float, float]] = []
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.stopped: str | None = None  # why stop() ended the learner's waits

    def put(self, group: EpisodeGroup) -> None:
        """Adds a complete group (every rollout of its prompt)."""
        with self._cond:
            gid = group.group_id
            if gid in self.groups or gid < self.next_group or gid in self.consumed:
                raise ValueError(f"group {gid} was already delivered")
            self.groups[group.group_id] = group
            self.counts["finished"] += 1
            self._finished_stats.append(_stats(group))
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """A producer died: wakes the learner so it raises instead of waiting."""
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def stop(self, reason: str) -> None:
        """Ends the learner's wait for data (get_batch raises Stopped, taking nothing)."""
        with self._cond:
            self.stopped = reason
            self._cond.notify_all()

    def _usable(self, g: EpisodeGroup) -> bool:
        return not (self.filter and len(set(g.rewards.tolist())) <= 1)

    def _advance(self) -> None:
        while self.next_group in self.consumed:
            self.consumed.remove(self.next_group)
            self.next_group += 1

    def _take_keep(self) -> EpisodeGroup | None:
        self._advance()
        g = self.groups.pop(self.next_group, None)
        if g is not None:
            self.next_group += 1
            self._advance()
        return g

    def _take_drop(self, version: int, eta: int) -> EpisodeGroup | None:
        while self.groups:
            gid = min(self.groups, key=lambda i: (self.groups[i].min_version, i))
            g = self.groups.pop(gid)
            self.consumed.add(gid)
            self._advance()
            if version - g.min_version > eta:
                self.counts["dropped"] += 1
                self.coord.free(1)
                continue
            return g
        return None

    def get_batch(self, n_groups: int, version: int, timeout: float) -> list[EpisodeGroup]:
        """The next n usable groups for the update at learner `version` (blocks, with deadline)."""
        out: list[EpisodeGroup] = []
        filtered = 0
        with self._cond:
            while len(out) < n_groups:

                def take():
                    if self.stale_policy == "keep":
                        return self._take_keep()
                    return self._take_drop(version, self.coord.eta)

                g = None
                ok = self._cond.wait_for(
                    lambda: (
                        self.error is not None
                        or self.stopped is not None
                        or bool(self.groups)
                        and (self.stale_policy == "drop" or self.next_group in self.groups)
                    ),
                    timeout,
                )
                if self.error is not None or self.stopped is not None or not ok:
                    missing, have = self.next_group, len(out)
                    self._put_back(out)  # a failed wait takes nothing
                    if self.stopped is not None:
                        raise Stopped(self.stopped)
                    if self.error is not None:
                        raise RuntimeError(f"rollout failed: {self.error!r}") from self.error
                    raise DeadlineError(
                        f"learner waited {timeout:g}s for group {missing} "
                        f"(have {have}/{n_groups} for version {version}; buffered "
                        f"{sorted(self.groups)[:8]}); are the rollout workers alive?"
                    )
                g = take()
                if g is None:
                    continue
                if not self._usable(g) and filtered < self.max_filtered_factor * n_groups:
                    filtered += 1
                    self.counts["filtered"] += 1
                    self.coord.free(1)
                    continue
                out.append(g)
            self.counts["trained"] += len(out)
            self._trained_stats.extend(_stats(g) for g in out)
        return out

    def _put_back(self, taken: list[EpisodeGroup]) -> None:
        """Undoes the taking of `taken` (groups filtered or dropped meanwhile stay consumed)."""
        if not taken:
            return
        ids = {g.group_id for g in taken}
        start = min(min(ids), self.next_group)
        self.consumed |= set(range(start, self.next_group)) - ids
        self.consumed -= ids
        self.next_group = start
        for g in taken:
            self.groups[g.group_id] = g
        self._advance()

    def state(self) -> tuple[dict, dict[int, EpisodeGroup]]:
        """(state, groups) for a checkpoint, taken together: the JSON-able consume cursor,
        numbers consumed above it ("drop") and counts; and the finished, untrained groups (for
        the checkpoint's groups file). GroupBuffer.from_state inverts it."""
        with self._cond:
            state = {
                "next_group": self.next_group,
                "consumed": sorted(self.consumed),
                "counts": dict(self.counts),
            }
            return state, dict(self.groups)

    @classmethod
    def from_state(
        cls,
        coordinator: Coordinator,
        state: Mapping,
        groups: Mapping[int, EpisodeGroup] | Iterable[EpisodeGroup],
        *,
        stale_policy: str = "keep",
        filter_zero_advantage: bool = True,
        max_filtered_factor: int = 4,
    ) -> GroupBuffer:
        """The buffer of a checkpoint's state() and groups ({} and (): a fresh one), feeding
        `coordinator` (Coordinator.from_state of the same checkpoint).

        The finished groups come back; every group dispatched but neither finished nor consumed
        (trained, filtered or dropped) when the checkpoint was taken is queued in the
        coordinator for dispatch again. A consumed group is never dispatched again.
        """
        buf = cls(
            coordinator,
            stale_policy=stale_policy,
            filter_zero_advantage=filter_zero_advantage,
            start_group=int(state.get("next_group", 0)),
            max_filtered_factor=max_filtered_factor,
        )
        buf.counts.update(state.get("counts", {}))
        buf.consumed = {int(i) for i in state.get("consumed", [])}
        for g in groups.values() if isinstance(groups, Mapping) else groups:
            gid = g.group_id
            if gid in buf.groups or gid < buf.next_group or gid in buf.consumed:
                raise ValueError(f"checkpoint holds group {gid} twice, or consumed and finished")
            buf.groups[gid] = g
        coordinator.resume_in_flight(buf.next_group, set(buf.groups) | buf.consumed)
        return buf

    def metrics(self) -> dict[str, float]:
        """Counts and the bias monitor (trained vs finished: length and reward means)."""
        with self._cond:
            m = {f"buffer/{k}": float(v) for k, v in self.counts.items()}
            m["buffer/size"] = float(len(self.groups))
            for name, stats in (
                ("finished", self._finished_stats),
                ("trained", self._trained_stats),
            ):
                if stats:
                    a = np.asarray(stats)
                    m[f"bias/length_{name}"] = float(a[:, 0].mean())
                    m[f"bias/reward_{name}"] = float(a[:, 1].mean())
            if self._finished_stats and self._trained_stats:
                m["bias/length_gap"] = m["bias/length_trained"] - m["bias/length_finished"]
                m["bias/reward_gap"] = m["bias/reward_trained"] - m["bias/reward_finished"]
        return m


def _stats(g: EpisodeGroup) -> tuple[float, float]:
    return (float(np.mean([e.num_generated for e in g.episodes])), float(g.rewards.mean()))
