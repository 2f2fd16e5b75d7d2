"""The checkpoint's groups file (rl.types codec), a resume of Coordinator + GroupBuffer through
a real Checkpointer, as the trainer does it, and the integrity checks of a restore: real Orbax
checkpoints damaged on disk, and write faults injected below Orbax."""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from flax import nnx
from test_coordinator import group, ids
from test_types import assert_groups_equal, sample_groups

from rl.buffer import GroupBuffer
from rl.checkpoint import (
    COMMIT_MARKER,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    load_groups,
    save_groups,
)
from rl.coordinator import Coordinator


def tiny_state(scale: float = 1.0) -> nnx.State:
    """A learner-shaped state: {0: params, 1: optimizer state}."""
    w = scale * jnp.arange(6.0).reshape(2, 3)
    return nnx.State({0: {"w": nnx.Param(w)}, 1: {"m": nnx.Variable(scale * jnp.ones(2))}})


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


# -- integrity -------------------------------------------------------------------------------


def two_checkpoints(directory, *, async_save=False) -> tuple[Checkpointer, list]:
    """Steps 1 and 2 with different states, metas and groups (step s holds s groups)."""
    ckpt = Checkpointer(directory, keep=3, async_save=async_save)
    groups = sample_groups()
    for step in (1, 2):
        by_id = {g.group_id: g for g in groups[:step]}
        ckpt.save(step, tiny_state(step), {"version": step}, by_id)
    ckpt.wait()
    return ckpt, groups


def assert_restores_step_1(directory, groups, *, skipped: str = "", why: str = ""):
    """A fresh Checkpointer restores step 1; with `skipped`, a warning names it and `why`."""
    ckpt = Checkpointer(directory, keep=3)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, meta, back = ckpt.restore(tiny_state(0.0))
    finally:
        ckpt.close()
    assert meta == {"version": 1}
    np.testing.assert_array_equal(np.asarray(state[0]["w"][...]), np.arange(6.0).reshape(2, 3))
    assert_groups_equal(groups[:1], list(back.values()))
    notes = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if not skipped:
        assert notes == []
        return
    assert len(notes) == 1, notes
    assert skipped in notes[0] and why in notes[0], notes[0]


def flip(path: str) -> None:
    """Inverts a few bytes in the middle of a file (size unchanged)."""
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 4)):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def truncate(path: str) -> None:
    """Cuts a file to half its length, as a write that stopped midway leaves it."""
    os.truncate(path, os.path.getsize(path) // 2)


def array_files(step_dir: str) -> list[str]:
    """The params item's data files Orbax reads on restore (its top-level OCDBT data)."""
    files = sorted(glob.glob(os.path.join(step_dir, "params", "d", "*")))
    assert files, os.listdir(os.path.join(step_dir, "params"))
    return files


# name -> (damage to checkpoint 2, what the warning must say)
DAMAGE = {
    "truncated groups file": (lambda d: truncate(f"{d}/groups_2.npz"), "has sha256"),
    "flipped groups bytes": (lambda d: flip(f"{d}/groups_2.npz"), "has sha256"),
    "deleted groups file": (lambda d: os.remove(f"{d}/groups_2.npz"), "is missing"),
    "deleted commit marker": (lambda d: os.remove(f"{d}/2/{COMMIT_MARKER}"), "not committed"),
    "deleted item marker": (
        lambda d: os.remove(f"{d}/2/optimizer/{COMMIT_MARKER}"),
        f"no optimizer/{COMMIT_MARKER}",
    ),
    "truncated array file": (lambda d: [truncate(f) for f in array_files(f"{d}/2")], "unreadable"),
    "flipped array bytes": (lambda d: [flip(f) for f in array_files(f"{d}/2")], "unreadable"),
    "truncated meta": (lambda d: truncate(f"{d}/2/meta/metadata"), "unreadable"),
    "deleted item": (lambda d: shutil.rmtree(f"{d}/2/params"), "not committed"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, damage):
    directory = str(tmp_path / "ckpt")
    ckpt, groups = two_checkpoints(directory)
    ckpt.close()
    corrupt, why = DAMAGE[damage]
    corrupt(directory)
    assert_restores_step_1(directory, groups, skipped=os.path.join(directory, "2"), why=why)


def test_no_valid_checkpoint_is_an_error_naming_each(tmp_path):
    directory = str(tmp_path / "ckpt")
    ckpt, _ = two_checkpoints(directory)
    ckpt.close()
    flip(f"{directory}/groups_2.npz")
    os.remove(f"{directory}/1/{COMMIT_MARKER}")
    ckpt = Checkpointer(directory)
    try:
        with pytest.warns(CheckpointWarning, match="ckpt/2 skipped"):
            with pytest.raises(CheckpointError, match="no valid checkpoint") as err:
                ckpt.restore(tiny_state())
        # asked for by number, a damaged step is an error, never another step
        with pytest.raises(CheckpointError, match="ckpt/1: not committed"):
            ckpt.restore(tiny_state(), step=1)
    finally:
        ckpt.close()
    assert f"{directory}/2: its groups file" in str(err.value)
    assert f"{directory}/1: not committed" in str(err.value)


def test_per_layer_checkpoint_into_stacked_layers_is_a_clear_error(tmp_path):
    """A checkpoint from before the decoder layers were stacked (model.layers.<i>.*) names
    that, rather than failing on the tree or a shape."""

    def state(layers: dict) -> nnx.State:
        return nnx.State({0: {"model": {"layers": layers}}, 1: {"m": nnx.Variable(jnp.ones(2))}})

    per_layer = state({str(i): {"w": nnx.Param(jnp.full(3, i + 1.0))} for i in range(2)})
    stacked = state({"w": nnx.Param(jnp.zeros((2, 3)))})
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        ckpt.save(1, per_layer, {"version": 1})
        with pytest.raises(ValueError, match="before the layers were stacked"):
            ckpt.restore(stacked)
        _, meta, _ = ckpt.restore(per_layer)  # the layout it was written with still restores
    finally:
        ckpt.close()
    assert meta["version"] == 1


def enospc(*_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# Faults injected around real Orbax, below it: the groups file's write, and the file that
# commits an Orbax step (the last file it writes before the rename that makes it visible).
def fail_groups_write(monkeypatch):
    monkeypatch.setattr(np, "savez", enospc)


def fail_commit_write(monkeypatch, armed=lambda: True):
    path_type = type(epath.Path("/"))
    write_text = path_type.write_text

    def failing(self, *args, **kwargs):
        if self.name == COMMIT_MARKER and armed():
            enospc()
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(path_type, "write_text", failing)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", [fail_groups_write, fail_commit_write], ids=lambda f: f.__name__)
def test_fake_enospc_write_fails_clearly_and_keeps_the_previous(tmp_path, fault, async_save):
    directory = str(tmp_path / "ckpt")
    ckpt, groups = two_checkpoints(directory, async_save=async_save)
    with pytest.MonkeyPatch.context() as mp:
        fault(mp)
        with pytest.raises(CheckpointError) as err:
            ckpt.save(3, tiny_state(3), {"version": 3}, {g.group_id: g for g in groups[:3]})
            ckpt.wait()  # an async save's failure comes at the next wait, save or close
    msg = str(err.value)
    assert f"{directory}/3 was not written" in msg and "No space left on device" in msg, msg
    assert "kept: [1, 2]" in msg, msg
    ckpt.close()
    assert sorted(os.listdir(directory)) == ["1", "2", "groups_1.npz", "groups_2.npz"]
    shutil.rmtree(f"{directory}/2")  # step 1, written before the fault, still restores
    os.remove(f"{directory}/groups_2.npz")
    assert_restores_step_1(directory, groups)


def test_fake_late_write_into_a_failed_saves_tmp_directory_is_removed_at_close(tmp_path):
    """A writer of Orbax's that outlasts a failed async save (simulated: a metadata file put into
    the step's tmp directory after the failure was reported) leaves nothing once closed."""
    directory = str(tmp_path / "ckpt")
    ckpt, groups = two_checkpoints(directory, async_save=True)
    with pytest.MonkeyPatch.context() as mp:
        fail_commit_write(mp)
        with pytest.raises(CheckpointError, match="was not written"):
            ckpt.save(3, tiny_state(3), {"version": 3}, {g.group_id: g for g in groups[:3]})
            ckpt.wait()
    late = f"{directory}/3.orbax-checkpoint-tmp"
    os.makedirs(late, exist_ok=True)
    with open(f"{late}/_CHECKPOINT_METADATA", "w") as f:
        f.write("{}")
    ckpt.close()
    assert sorted(os.listdir(directory)) == ["1", "2", "groups_1.npz", "groups_2.npz"]
