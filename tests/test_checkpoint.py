"""The checkpoint's groups file (rl.types codec) and a resume of Coordinator + GroupBuffer through
a real Checkpointer, as the trainer does it."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_coordinator import group, ids
from test_types import assert_groups_equal, sample_groups

from rl.buffer import GroupBuffer
from rl.checkpoint import Checkpointer, load_groups, save_groups
from rl.coordinator import Coordinator


def tiny_state() -> nnx.State:
    """A learner-shaped state: {0: params, 1: optimizer state}."""
    return nnx.State(
        {0: {"w": nnx.Param(jnp.arange(6.0).reshape(2, 3))}, 1: {"m": nnx.Variable(jnp.ones(2))}}
    )


def test_groups_file_round_trip(tmp_path):
    """Written (from a dict or a sequence) and read back equal, with no pickle; atomic rename."""
    groups = sample_groups()
    path = str(tmp_path / "groups_3.npz")
    save_groups(path, {g.group_id: g for g in groups})
    assert os.listdir(tmp_path) == ["groups_3.npz"]  # the temporary file was renamed
    back = load_groups(path)
    assert list(back) == [g.group_id for g in groups]
    assert_groups_equal(groups, list(back.values()))
    with np.load(path, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    save_groups(path, groups[:2])  # a sequence, over the old file
    assert_groups_equal(groups[:2], list(load_groups(path).values()))
    save_groups(path, {})
    assert load_groups(path) == {}
    assert load_groups(str(tmp_path / "missing.npz")) == {}


def test_old_groups_file_is_named_not_misread(tmp_path):
    path = str(tmp_path / "groups_1.npz")
    np.savez(path, __index__=np.frombuffer(b"[]", np.uint8))
    with pytest.raises(ValueError, match="format before groups_to_arrays"):
        load_groups(path)


def test_checkpointer_groups_and_retention(tmp_path):
    """groups_<step>.npz comes back with its step; files of steps Orbax dropped are removed."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    groups = sample_groups()
    try:
        for step in (1, 2, 3):
            ckpt.save(step, tiny_state(), {"version": step}, {g.group_id: g for g in groups[:step]})
        names = sorted(n for n in os.listdir(ckpt.directory) if n.startswith("groups_"))
        assert names == ["groups_2.npz", "groups_3.npz"]
        state, meta, back = ckpt.restore(tiny_state())
        assert meta == {"version": 3}
        assert_groups_equal(groups[:3], list(back.values()))
    finally:
        ckpt.close()


def test_resume_through_a_checkpoint(tmp_path):
    """The trainer's save / resume path: coord.state() and buffer.state() into a checkpoint's
    meta and groups file, back through Coordinator.from_state / GroupBuffer.from_state."""
    c = Coordinator(2, 1)
    buf = GroupBuffer(c, stale_policy="drop")
    c.admit(4, timeout=0.01)
    c.publish(1)
    c.admit(5, timeout=0.01)  # 0..5 dispatched
    for gid, r, v in [(1, [0, 1], 0), (2, [1, 1], 1), (4, [0, 1], 1), (5, [1, 0], 1)]:
        buf.put(group(gid, r, version=v))
    assert ids(buf.get_batch(1, 2, timeout=0.01)) == [4]  # 1 dropped, 2 filtered
    c.requeue([3])
    bstate, groups = buf.state()
    meta = {"step": 2, "version": 2, "coordinator": c.state(), "buffer": bstate, "sft_done": True}
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        ckpt.save(2, tiny_state(), meta, groups)
        _, meta2, groups2 = ckpt.restore(tiny_state())
    finally:
        ckpt.close()
    assert meta2 == json.loads(json.dumps(meta))
    c2 = Coordinator.from_state(
        meta2["coordinator"], groups_per_update=2, max_staleness=1, published_version=2
    )
    b2 = GroupBuffer.from_state(c2, meta2["buffer"], groups2, stale_policy="drop")
    assert c2.state() == c.state() and b2.state()[0] == bstate
    assert_groups_equal(list(groups.values()), list(b2.state()[1].values()))
    assert list(c2.retry) == [0, 3]  # in flight; 1, 2, 4 consumed, 5 finished
    c.publish(2)
    assert c2.capacity() - len(c2.retry) == c.capacity() - len(c.retry) == 4
