"""Coordinator (admission under the staleness bound) and GroupBuffer unit tests, hand-computed."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from rl.buffer import GroupBuffer
from rl.coordinator import Coordinator, DeadlineError
from rl.types import Episode, EpisodeGroup


def episode(gid: int, reward: float, length: int = 2, version: int = 0) -> Episode:
    """A 1-token prompt + `length` generated tokens at `version`."""
    return Episode(
        problem_id=f"p{gid}",
        tokens=np.arange(1 + length),
        loss_mask=[0] + [1] * length,
        behavior_logp=np.zeros(1 + length),
        versions=[-1] + [version] * length,
        prompt_len=1,
        reward=reward,
    )


def group(gid: int, rewards, lengths=None, version: int = 0) -> EpisodeGroup:
    """A group of len(rewards) episodes, all tokens at `version`."""
    lengths = lengths or [2] * len(rewards)
    eps = tuple(episode(gid, r, n, version) for r, n in zip(rewards, lengths))
    return EpisodeGroup(gid, f"p{gid}", eps, version)


def ids(groups) -> list[int]:
    return [g.group_id for g in groups]


def in_thread(fn):
    """Starts fn in a daemon thread; returns (thread, result dict with 'value' or 'error')."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
        out["time"] = time.perf_counter()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# -- admission ---------------------------------------------------------------------------------
def test_admission_capacity_follows_bound():
    """B=2, eta=1: limit (1 + v + 1) * 2 + freed; hand-computed sequence."""
    c = Coordinator(2, 1)
    assert c.capacity() == 4  # (1 + 0 + 1) * 2
    assert c.admit(10, timeout=0.01) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert c.capacity() == 0
    c.publish(1)
    assert c.capacity() == 2  # 6 - 4
    assert c.admit(1, timeout=0.01) == [(4, 1)]
    assert c.admit(5, timeout=0.01) == [(5, 1)]
    assert c.capacity() == 0
    c.free(3)  # three consumed-untrained groups
    assert c.capacity() == 3  # 6 + 3 - 6
    assert c.admit(2, timeout=0.01) == [(6, 1), (7, 1)]
    c.publish(3)
    assert c.capacity() == 1 + 4  # 10 + 3 - 8
    assert c.admit(9, timeout=0.01) == [(8, 3), (9, 3), (10, 3), (11, 3), (12, 3)]
    assert c.capacity() == 0


def test_admission_eta0_is_one_batch_per_version():
    """eta=0: exactly B groups per published version (synchronous)."""
    c = Coordinator(3, 0)
    got = []
    for v in range(4):
        c.publish(v)
        got.append(c.admit(10, timeout=0.01))
        assert c.capacity() == 0
    assert got == [[(3 * v + i, v) for i in range(3)] for v in range(4)]


def test_admission_resume_and_total_groups():
    """start_group / published_version resume the count; total_groups caps it (+freed)."""
    c = Coordinator(2, 1, start_group=6, published_version=2)
    assert c.capacity() == 2  # (1 + 2 + 1) * 2 - 6
    assert c.admit(5, timeout=0.01) == [(6, 2), (7, 2)]
    c = Coordinator(2, 0, total_groups=3)
    assert c.capacity() == 2  # min(2, 3)
    c.admit(5, timeout=0.01)
    c.publish(1)
    assert c.capacity() == 1  # min(4, 3) - 2
    c.free(1)
    assert c.capacity() == 2  # min(4 + 1, 3 + 1) - 2


def test_published_version_is_min_over_engines():
    """Admission counts the oldest weights any engine serves."""
    c = Coordinator(1, 0)
    c.publish(3, engine="a")
    c.publish(2, engine="b")
    assert c.published_version == 2 and c.capacity() == 3  # (0 + 2 + 1) * 1
    c.publish(4, engine="b")
    assert c.published_version == 3


def test_admit_deadline_names_what_it_waited_for():
    """A full window blocks admit; after the timeout a DeadlineError says why."""
    c = Coordinator(2, 1)
    c.admit(4, timeout=0.01)
    t0 = time.perf_counter()
    with pytest.raises(DeadlineError) as ei:
        c.admit(1, timeout=0.05)
    assert time.perf_counter() - t0 >= 0.05
    msg = str(ei.value)
    for part in ("0.05s", "admission", "published version 0", "4 groups dispatched", "eta=1"):
        assert part in msg, (part, msg)
    assert isinstance(ei.value, TimeoutError)


def test_admit_wakes_on_publish():
    """A blocked admit returns as soon as a publish opens the window."""
    c = Coordinator(1, 0)
    c.admit(1, timeout=0.01)
    t, out = in_thread(lambda: c.admit(5, timeout=10))
    time.sleep(0.05)
    assert t.is_alive()
    c.publish(1)
    t.join(5)
    assert out["value"] == [(1, 1)]


def test_stop_wakes_waiters():
    """stop() releases every blocked admit with [] (not after its timeout); later admits too."""
    c = Coordinator(1, 0)
    c.admit(1, timeout=0.01)
    waiters = [in_thread(lambda: c.admit(1, timeout=30)) for _ in range(3)]
    time.sleep(0.05)
    t_stop = time.perf_counter()
    c.stop()
    for t, out in waiters:
        t.join(5)
        assert out["value"] == [] and out["time"] - t_stop < 2.0
    c.publish(5)  # capacity again, still stopped
    assert c.admit(1, timeout=0.01) == []


def test_requeue_redispatches_same_numbers_first():
    """Requeued groups come back first, lowest number first, at the current version."""
    c = Coordinator(2, 0)
    assert ids_of(c.admit(2, timeout=0.01)) == [0, 1]
    c.publish(1)
    assert ids_of(c.admit(1, timeout=0.01)) == [2]
    c.requeue([1, 0])
    assert c.redispatched == 2 and c.capacity() == 1 + 2
    assert c.admit(1, timeout=0.01) == [(0, 1)]
    assert c.admit(5, timeout=0.01) == [(1, 1), (3, 1)]
    assert not c.retry and c.state() == {"dispatched": 4, "freed": 0, "redispatched": 2}


def test_requeue_admits_past_a_full_window():
    """Failed work is dispatched again even when no new group may start; a waiter wakes."""
    c = Coordinator(1, 0)
    c.admit(1, timeout=0.01)
    t, out = in_thread(lambda: c.admit(3, timeout=10))
    time.sleep(0.05)
    c.requeue([0])
    t.join(5)
    assert out["value"] == [(0, 0)]


def ids_of(admitted) -> list[int]:
    return [g for g, _ in admitted]


# -- the buffer ----------------------------------------------------------------------------------
def test_keep_releases_in_dispatch_order():
    """Keep: groups leave strictly by number, whatever order they finished in."""
    buf = GroupBuffer(Coordinator(2, 1), filter_zero_advantage=False)
    for gid in (3, 1, 2, 0):
        buf.put(group(gid, [0, 1]))
    assert ids(buf.get_batch(2, 0, timeout=0.01)) == [0, 1]
    assert ids(buf.get_batch(2, 1, timeout=0.01)) == [2, 3]


def test_get_batch_deadline_names_missing_group():
    """The learner's wait has a deadline; the message names the group it waited for, and the
    failed wait takes nothing (group 0 is still buffered)."""
    buf = GroupBuffer(Coordinator(2, 1))
    buf.put(group(0, [0, 1]))
    buf.put(group(2, [0, 1]))
    t0 = time.perf_counter()
    with pytest.raises(DeadlineError) as ei:
        buf.get_batch(2, 0, timeout=0.05)
    assert time.perf_counter() - t0 >= 0.05
    msg = str(ei.value)
    assert "waited 0.05s for group 1" in msg and "have 1/2 for version 0" in msg, msg
    assert "buffered [0, 2]" in msg, msg
    assert sorted(buf.state()[1]) == [0, 2] and buf.state()[0]["next_group"] == 0


def test_fail_makes_get_batch_raise_promptly():
    """A dead producer wakes the waiting learner at once; the cause is chained."""
    buf = GroupBuffer(Coordinator(2, 1))
    t, out = in_thread(lambda: buf.get_batch(2, 0, timeout=30))
    time.sleep(0.05)
    t_fail = time.perf_counter()
    boom = ValueError("engine 3 died")
    buf.fail(boom)
    t.join(5)
    e = out["error"]
    assert isinstance(e, RuntimeError) and "engine 3 died" in str(e) and e.__cause__ is boom
    assert out["time"] - t_fail < 2.0
    with pytest.raises(RuntimeError, match="engine 3 died"):  # and every later call
        buf.get_batch(1, 0, timeout=30)


def test_put_rejects_duplicates():
    """A group delivered twice (buffered, or already consumed) is an error, not trained twice."""
    for policy in ("keep", "drop"):
        buf = GroupBuffer(Coordinator(1, 1), stale_policy=policy, filter_zero_advantage=False)
        buf.put(group(0, [0, 1]))
        with pytest.raises(ValueError, match="group 0 was already delivered"):
            buf.put(group(0, [0, 1]))
        buf.put(group(2, [0, 1], version=1))
        buf.put(group(1, [0, 1]))
        assert ids(buf.get_batch(1, 1, timeout=0.01)) == [0]  # drop: oldest version first
        with pytest.raises(ValueError, match="group 0 was already delivered"):
            buf.put(group(0, [0, 1]))  # consumed: a late copy from a worker thought dead
        assert buf.counts["finished"] == 3


def test_drop_policy_counts_drops():
    """Drop: oldest tokens first; more than eta versions behind the update -> dropped, counted,
    slot freed; exactly eta behind is kept. The consume cursor tracks out-of-order consumption."""
    c = Coordinator(1, 1)
    buf = GroupBuffer(c, stale_policy="drop", filter_zero_advantage=False)
    buf.put(group(0, [0, 1], version=3))
    buf.put(group(1, [0, 1], version=1))  # 4 - 1 = 3 > eta: dropped
    buf.put(group(2, [0, 1], version=2))  # 4 - 2 = 2 > eta: dropped
    buf.put(group(3, [0, 1], version=3))  # 4 - 3 = 1 == eta: kept
    assert ids(buf.get_batch(1, 4, timeout=0.01)) == [0]  # version 3, lowest number first
    assert buf.counts["dropped"] == 2 and c.freed == 2
    assert buf.state()[0]["next_group"] == 3 and buf.state()[0]["consumed"] == []
    assert ids(buf.get_batch(1, 4, timeout=0.01)) == [3]
    assert buf.counts == {"filtered": 0, "dropped": 2, "trained": 2, "finished": 4, "lost": 0}
    buf.put(group(5, [0, 1], version=4))
    assert ids(buf.get_batch(1, 4, timeout=0.01)) == [5]
    assert buf.state()[0]["next_group"] == 4 and buf.state()[0]["consumed"] == [5]
    with pytest.raises(ValueError, match="group 5 was already delivered"):
        buf.put(group(5, [0, 1], version=4))


def test_keep_never_drops():
    """Keep trains a very stale group (admission, not the buffer, bounds staleness)."""
    buf = GroupBuffer(Coordinator(1, 0), filter_zero_advantage=False)
    buf.put(group(0, [0, 1], version=0))
    assert ids(buf.get_batch(1, 9, timeout=0.01)) == [0] and buf.counts["dropped"] == 0


def test_zero_advantage_filter_counts_and_frees():
    """All-equal rewards are filtered, counted and free their admission slots."""
    c = Coordinator(2, 0)
    c.admit(2, timeout=0.01)
    buf = GroupBuffer(c)
    for gid, r in [(0, [1, 1]), (1, [0, 1]), (2, [0, 0]), (3, [1, 0])]:
        buf.put(group(gid, r))
    assert c.capacity() == 0
    assert ids(buf.get_batch(2, 0, timeout=0.01)) == [1, 3]
    assert buf.counts["filtered"] == 2 and c.freed == 2 and c.capacity() == 2
    # Off: the same groups are trained.
    buf = GroupBuffer(Coordinator(2, 0), filter_zero_advantage=False)
    for gid, r in [(0, [1, 1]), (1, [0, 1])]:
        buf.put(group(gid, r))
    assert ids(buf.get_batch(2, 0, timeout=0.01)) == [0, 1] and buf.counts["filtered"] == 0


def test_filter_cap_stops_endless_search():
    """max_filtered_factor * n_groups filtered per batch at most; then zero-advantage trains."""
    c = Coordinator(2, 0)
    buf = GroupBuffer(c, max_filtered_factor=1)
    for gid in range(6):
        buf.put(group(gid, [1, 1]))
    assert ids(buf.get_batch(2, 0, timeout=0.01)) == [2, 3]  # 0, 1 filtered (cap 1 * 2)
    assert buf.counts["filtered"] == 2 and buf.counts["trained"] == 2 and c.freed == 2
    assert ids(buf.get_batch(1, 1, timeout=0.01)) == [5]  # cap resets per batch: 4 filtered
    assert buf.counts["filtered"] == 3 and c.freed == 3


def test_bias_metrics_hand_values():
    """Trained vs finished: means over groups of (mean generated length, mean reward)."""
    buf = GroupBuffer(Coordinator(2, 0))
    buf.put(group(0, [1, 1], lengths=[2, 4]))  # (3, 1.0), filtered
    buf.put(group(1, [1, 0], lengths=[1, 3]))  # (2, 0.5)
    buf.put(group(2, [1, 1], lengths=[5, 5]))  # (5, 1.0), filtered
    buf.put(group(3, [0, 1], lengths=[2, 2]))  # (2, 0.5)
    assert buf.metrics()["bias/length_finished"] == 3.0
    assert "bias/length_trained" not in buf.metrics()
    buf.get_batch(2, 0, timeout=0.01)
    m = buf.metrics()
    want = {
        "buffer/filtered": 2.0,
        "buffer/dropped": 0.0,
        "buffer/trained": 2.0,
        "buffer/lost": 0.0,
        "buffer/finished": 4.0,
        "buffer/size": 0.0,
        "rollout/tokens_discarded": 0.0,
        "bias/length_finished": 3.0,  # (3 + 2 + 5 + 2) / 4
        "bias/reward_finished": 0.75,  # (1 + 0.5 + 1 + 0.5) / 4
        "bias/length_trained": 2.0,
        "bias/reward_trained": 0.5,
        "bias/length_gap": -1.0,
        "bias/reward_gap": -0.25,
    }
    assert m == pytest.approx(want)


def test_sampled_metrics_cover_filtered_groups_and_reset_per_window():
    """sampled/*: every finished episode since the previous call, filtered groups included,
    where reward/* of the update sees the trained groups only."""
    import dataclasses

    def g(gid, rewards):
        grp = group(gid, rewards)
        eps = tuple(dataclasses.replace(e, correct=e.reward == 1.0) for e in grp.episodes)
        return dataclasses.replace(grp, episodes=eps)

    buf = GroupBuffer(Coordinator(2, 0))
    assert buf.sampled() == {}
    for gid, rewards in enumerate([[0, 0], [1, 0], [0, 0], [0.1, 1]]):
        buf.put(g(gid, rewards))
    trained = buf.get_batch(2, 0, timeout=0.01)
    assert ids(trained) == [1, 3] and buf.metrics()["buffer/filtered"] == 2.0
    assert buf.sampled() == pytest.approx({"sampled/reward": 2.1 / 8, "sampled/correct": 2 / 8})
    assert buf.sampled() == {}  # a new window
    buf.put(g(4, [1, 1]))
    assert buf.sampled() == pytest.approx({"sampled/reward": 1.0, "sampled/correct": 1.0})


# -- checkpoint state and resume -----------------------------------------------------------------
def restore(coord: Coordinator, buf: GroupBuffer, published_version: int):
    """The pair a resume builds from a checkpoint of (coord, buf), meta through JSON as on disk."""
    bstate, groups = buf.state()
    meta = json.loads(json.dumps({"coordinator": coord.state(), "buffer": bstate}))
    c = Coordinator.from_state(
        meta["coordinator"],
        groups_per_update=coord.B,
        max_staleness=coord.eta,
        published_version=published_version,
    )
    b = GroupBuffer.from_state(
        c, meta["buffer"], groups, stale_policy=buf.stale_policy, filter_zero_advantage=buf.filter
    )
    return c, b


def test_state_round_trip():
    """state -> (JSON) -> from_state -> state is the identity, for both; groups come back."""
    c = Coordinator(2, 1)
    buf = GroupBuffer(c, stale_policy="drop")
    c.admit(4, timeout=0.01)
    for gid, r, v in [(1, [0, 1], 0), (2, [1, 1], 1), (3, [0, 1], 1), (0, [1, 0], 2)]:
        buf.put(group(gid, r, version=v))
    assert ids(buf.get_batch(1, 2, timeout=0.01)) == [3]  # 1 dropped, 2 filtered, 3 trained
    c.requeue([0])  # finished and delivered, but a worker thought it lost
    bstate, groups = buf.state()
    assert bstate == {
        "next_group": 0,
        "consumed": [1, 2, 3],
        "counts": {"filtered": 1, "dropped": 1, "trained": 1, "finished": 4, "lost": 0},
        "tokens_discarded": 0,
    }
    assert c.state() == {"dispatched": 4, "freed": 2, "redispatched": 1}
    c2, b2 = restore(c, buf, published_version=0)
    assert c2.state() == c.state()
    b2state, groups2 = b2.state()
    assert b2state == bstate and groups2 == groups and groups2[0] is groups[0]
    assert list(c2.retry) == []  # 0 is finished: not dispatched again
    fresh_c, fresh_b = restore(Coordinator(2, 1), GroupBuffer(Coordinator(2, 1)), 0)
    assert fresh_c.state() == Coordinator(2, 1).state() and not fresh_c.retry
    assert fresh_b.state() == GroupBuffer(Coordinator(2, 1)).state()
    empty = Coordinator.from_state({}, groups_per_update=2, max_staleness=1)
    assert empty.state() == Coordinator(2, 1).state()
    assert GroupBuffer.from_state(empty, {}, {}).state() == GroupBuffer(empty).state()


def test_resume_drop_redispatches_exactly_in_flight():
    """Drop policy, filtering: the restored pair dispatches again exactly the groups in flight
    (a requeued one and one a worker still ran), never a consumed one, then new groups under
    the same admission bound as the original."""
    c = Coordinator(2, 1)
    buf = GroupBuffer(c, stale_policy="drop")
    assert ids_of(c.admit(4, timeout=0.01)) == [0, 1, 2, 3]
    c.publish(1)
    assert ids_of(c.admit(5, timeout=0.01)) == [4, 5]
    buf.put(group(1, [0, 1], version=0))  # 2 - 0 > eta: dropped
    buf.put(group(2, [1, 1], version=1))  # zero advantage: filtered
    buf.put(group(4, [0, 1], version=1))  # trained
    buf.put(group(5, [1, 0], version=1))  # finished, waits in the buffer
    assert ids(buf.get_batch(1, 2, timeout=0.01)) == [4]
    assert c.freed == 2 and buf.state()[0]["consumed"] == [1, 2, 4]  # cursor still at 0
    c.requeue([3])  # 3's worker died; 0 is still running
    c.publish(2)
    c2, b2 = restore(c, buf, published_version=2)
    assert list(c2.retry) == [0, 3]
    assert c2.capacity() - len(c2.retry) == c.capacity() - len(c.retry) == 4  # 8 + 2 - 6
    assert c2.admit(10, timeout=0.01) == [(0, 2), (3, 2), (6, 2), (7, 2), (8, 2), (9, 2)]
    assert c.admit(10, timeout=0.01) == [(3, 2), (6, 2), (7, 2), (8, 2), (9, 2)]
    assert c2.capacity() == c.capacity() == 0
    for gid in (1, 2, 4, 5):  # consumed, or finished and restored
        with pytest.raises(ValueError, match=f"group {gid} was already delivered"):
            b2.put(group(gid, [0, 1], version=2))
    b2.put(group(0, [0, 1], version=2))
    b2.put(group(3, [1, 0], version=2))
    assert ids(b2.get_batch(3, 2, timeout=0.01)) == [5, 0, 3]  # oldest tokens first
    assert b2.state()[0] == {
        "next_group": 6,
        "consumed": [],
        "counts": {"filtered": 1, "dropped": 1, "trained": 4, "finished": 6, "lost": 0},
        "tokens_discarded": 0,
    }
    assert c2.state() == {"dispatched": 10, "freed": 2, "redispatched": 1}


def test_resume_keep_redispatches_exactly_in_flight():
    """Keep policy: the cursor and the buffered groups decide; training order is unchanged."""
    c = Coordinator(2, 1)
    buf = GroupBuffer(c)
    c.admit(4, timeout=0.01)
    for gid, r in [(0, [1, 1]), (1, [0, 1]), (3, [0, 1])]:
        buf.put(group(gid, r))
    assert ids(buf.get_batch(1, 0, timeout=0.01)) == [1]  # 0 filtered
    assert c.admit(5, timeout=0.01) == [(4, 0)]  # the freed slot
    c2, b2 = restore(c, buf, published_version=0)
    assert list(c2.retry) == [2, 4]
    assert c2.capacity() - len(c2.retry) == c.capacity() - len(c.retry) == 0
    assert c2.admit(5, timeout=0.01) == [(2, 0), (4, 0)] and c2.capacity() == 0
    with pytest.raises(ValueError, match="group 1 was already delivered"):
        b2.put(group(1, [0, 1]))
    b2.put(group(4, [0, 1]))
    b2.put(group(2, [0, 1]))
    assert ids(b2.get_batch(3, 0, timeout=0.01)) == [2, 3, 4]
    c2.publish(1)
    assert ids_of(c2.admit(5, timeout=0.01)) == [5, 6]  # (1 + 1 + 1) * 2 + 1 - 5


def test_from_state_rejects_inconsistent_checkpoint():
    """A group both consumed and finished (or below the cursor) in a checkpoint is an error."""
    c = Coordinator.from_state({"dispatched": 4}, groups_per_update=2, max_staleness=1)
    with pytest.raises(ValueError, match="group 1"):
        GroupBuffer.from_state(c, {"next_group": 2}, [group(1, [0, 1])])
    with pytest.raises(ValueError, match="group 3"):
        GroupBuffer.from_state(c, {"next_group": 0, "consumed": [3]}, {3: group(3, [0, 1])})


def test_resume_counts_a_group_past_the_dispatch_count_as_dispatched():
    """A checkpoint whose buffer holds a group past the coordinator's count (its state taken
    first, the group admitted and finished after) does not hand that number out again."""
    c = Coordinator.from_state({"dispatched": 2}, groups_per_update=2, max_staleness=1)
    GroupBuffer.from_state(c, {"next_group": 0}, {2: group(2, [0, 1])})
    assert list(c.retry) == [0, 1] and c.state()["dispatched"] == 3
    assert ids_of(c.admit(5, timeout=0.01)) == [0, 1, 3]
