"""Admission control: the staleness bound, enforced when work is dispatched.

Groups are numbered in dispatch order g = 0, 1, 2, ... (the data cursor). With B groups per
update, published version v and bound eta, a new group may be dispatched only while

    dispatched_groups < (eta + v + 1) * B            (AReaL's rule, in versions)

and, with stale_policy "keep", the learner consumes groups strictly in dispatch order, B usable
groups per update. Then group g is trained by the update that produces version k + 1 with
k <= floor(g / B), and was dispatched at a published version >= floor(g / B) - eta; engines
serve at least the published version, so every trained token has staleness k - version <= eta.
eta = 0 with sync_every = 1 is exactly synchronous on-policy RL.

Groups consumed without training (all-equal rewards filtered, or dropped) free their slots,
so the learner always finds B usable groups (dynamic sampling) and the bound still holds.
Failed work is re-dispatched under its original number (it can only get fresher). Nothing
finished is thrown away unless stale_policy is "drop".
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping


class DeadlineError(TimeoutError):
    """A wait passed its deadline; the message says what was awaited."""


class Coordinator:
    """Hands out group numbers under the staleness bound; tracks published versions."""

    def __init__(
        self,
        groups_per_update: int,
        max_staleness: int,
        *,
        start_group: int = 0,
        published_version: int = 0,
        total_groups: int | None = None,
        controller=None,
    ):
        self.B = groups_per_update
        self.eta = max_staleness
        self.controller = controller  # rl.staleness.EtaController: eta set online, or fixed
        self.next_group = start_group
        self.published_version = published_version
        self.total_groups = total_groups
        self.retry: collections.deque[int] = collections.deque()
        self.freed = 0
        self.redispatched = 0
        self.stopped = False
        self.engine_versions: dict[str, int] = {}
        self._cond = threading.Condition()

    def capacity(self) -> int:
        """Groups that may be dispatched now."""
        limit = (self.eta + self.published_version + 1) * self.B + self.freed
        if self.total_groups is not None:
            limit = min(limit, self.total_groups + self.freed)
        return max(0, limit - self.next_group) + len(self.retry)

    def admit(self, max_groups: int, timeout: float) -> list[tuple[int, int]]:
        """Blocks until work is admissible; returns [(group number, published version)].

        Returns [] once stop() was called; raises DeadlineError after `timeout` seconds.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: self.stopped or self.capacity() > 0, timeout)
            if self.stopped:
                return []
            if not ok:
                raise DeadlineError(
                    f"rollout waited {timeout:g}s for admission: published version "
                    f"{self.published_version}, {self.next_group} groups dispatched, bound "
                    f"(eta={self.eta} + v + 1) * {self.B}; is the learner stuck?"
                )
            out = []
            while self.retry and len(out) < max_groups:
                out.append((self.retry.popleft(), self.published_version))
            n = min(max_groups - len(out), self.capacity() - len(self.retry))
            for _ in range(max(0, n)):
                out.append((self.next_group, self.published_version))
                self.next_group += 1
            return out

    def requeue(self, groups: list[int]) -> None:
        """Failed work goes back to be dispatched again first (same group numbers)."""
        with self._cond:
            self.retry.extend(sorted(groups))
            self.redispatched += len(groups)
            self._cond.notify_all()

    def free(self, n: int) -> None:
        """Frees the slots of n consumed-but-untrained groups (filtered, or dropped as stale).

        The bound still holds: every freed group has a lower number than any group dispatched
        after it, so a group trained by update k still has number - freed_before >= k * B.
        """
        with self._cond:
            self.freed += n
            self._cond.notify_all()

    def publish(self, version: int, engine: str = "engine0") -> None:
        """Records that engine serves `version`; the published version is the minimum served."""
        with self._cond:
            self.engine_versions[engine] = version
            self.published_version = min(self.engine_versions.values())
            self._cond.notify_all()

    def set_eta(self, eta: int) -> None:
        """A new bound for the admissions that follow (adaptive staleness). Lowering it pauses
        admission until the published version catches up; groups already admitted keep the
        bound they were admitted under, and nothing finished is discarded."""
        with self._cond:
            self.eta = eta
            self._cond.notify_all()

    def adapt(self, row: dict) -> dict:
        """After an update: the bound its row reports, and with a controller the bound it sets
        from the row's drift for the admissions that follow (staleness/eta)."""
        out = {"staleness/bound": float(self.eta)}
        if self.controller is not None:
            self.set_eta(self.controller.observe(row))
            out["staleness/eta"] = float(self.eta)
        return out

    def stop(self) -> None:
        """Wakes every waiter; admit() returns [] from now on."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def state(self) -> dict:
        """The admission state a checkpoint keeps (JSON-able): groups dispatched so far (the next
        number), slots freed, groups redispatched. Requeued groups are not in it: on resume,
        GroupBuffer.from_state re-dispatches every group that was in flight, requeued included.
        """
        with self._cond:
            out = {
                "dispatched": self.next_group,
                "freed": self.freed,
                "redispatched": self.redispatched,
            }
            if self.controller is not None:
                out["eta_control"] = self.controller.state()
            return out

    @classmethod
    def from_state(
        cls,
        state: Mapping,
        *,
        groups_per_update: int,
        max_staleness: int,
        published_version: int = 0,
        total_groups: int | None = None,
        controller=None,
    ) -> Coordinator:
        """The coordinator of a checkpoint's state() ({}: a fresh one). Give it, with the
        checkpoint's buffer state and groups, to GroupBuffer.from_state, which queues the groups
        that were in flight for dispatch."""
        if controller is not None:  # an adaptive run continues with the eta it had reached
            controller.restore(state.get("eta_control", {}))
            max_staleness = controller.eta
        c = cls(
            groups_per_update,
            max_staleness,
            start_group=int(state.get("dispatched", 0)),
            published_version=published_version,
            total_groups=total_groups,
            controller=controller,
        )
        c.freed = int(state.get("freed", 0))
        c.redispatched = int(state.get("redispatched", 0))
        return c

    def prioritize(self, groups: Iterable[int]) -> None:
        """Moves `groups` (queued for dispatch again) to the front of the queue, lowest first:
        a resumed run continues its saved partial groups before anything else. A group not
        queued is an error (the checkpoint's partials and its in-flight groups disagree)."""
        first = sorted(set(groups))
        with self._cond:
            missing = [g for g in first if g not in self.retry]
            if missing:
                raise ValueError(
                    f"groups {missing} are not queued for dispatch (queued: "
                    f"{sorted(self.retry)[:16]}); a partial group must be one in flight"
                )
            rest = [g for g in self.retry if g not in set(first)]
            self.retry = collections.deque(first + rest)

    def resume_in_flight(self, cursor: int, done: Iterable[int]) -> None:
        """On resume (GroupBuffer.from_state): every group numbered from `cursor` (the buffer's
        consume cursor, below which all were consumed) up to the dispatch count that is not in
        `done` (finished or consumed when the checkpoint was taken) was in flight, and is
        dispatched again first, lowest number first. A group in `done` counts as dispatched.
        Not counted as redispatched: the checkpoint, not a failure, lost them.
        """
        done = set(done)
        with self._cond:
            self.next_group = max(self.next_group, cursor, max(done, default=-1) + 1)
            self.retry.extend(i for i in range(cursor, self.next_group) if i not in done)
            self._cond.notify_all()
