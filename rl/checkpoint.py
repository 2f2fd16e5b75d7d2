"""Orbax checkpoints of the learner state plus everything a resumed run needs.

A checkpoint at version v holds: params and optimizer state (sharded arrays, StandardSave),
and a JSON `meta` item with the version, the stage, and the Coordinator's and GroupBuffer's
state() (data cursor, admission state, counters). Finished but untrained groups are written
next to it as `groups_<step>.npz` (the arrays of rl.types.groups_to_arrays), so a resumed run
loses no finished episode and re-dispatches only what was in flight.

A learner over several hosts checkpoints from every process: each writes its own shards, Orbax's
primary (process 0) the metadata; the groups file and retention are process 0's. A `layout` item
records the writers' process and device counts, so a restore that cannot fit says so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from rl import distributed
from rl.types import EpisodeGroup, groups_from_arrays, groups_to_arrays


def save_groups(path: str, groups: Mapping[int, EpisodeGroup] | Iterable[EpisodeGroup]) -> None:
    """Writes groups (by group number or as a sequence) to an npz of groups_to_arrays' arrays.

    Written to a temporary file and renamed: a reader sees the old file or the whole new one.
    """
    if isinstance(groups, Mapping):
        groups = groups.values()
    tmp = path + ".tmp.npz"
    np.savez(tmp, **groups_to_arrays(list(groups)))
    os.replace(tmp, path)


def load_groups(path: str) -> dict[int, EpisodeGroup]:
    """{group number: EpisodeGroup} of a save_groups file ({} if there is none); no pickle."""
    if not os.path.exists(path):
        return {}
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if "__index__" in arrays:
        raise ValueError(
            f"{path} is a groups file of the format before groups_to_arrays (a JSON index); "
            "resume this checkpoint with the code that wrote it"
        )
    return {g.group_id: g for g in groups_from_arrays(arrays)}


class Checkpointer:
    """Saves and restores (learner state, meta, buffered groups) under run_dir/checkpoints.

    With async_save the learner waits only while the arrays are copied off its devices; Orbax
    writes them in the background and commits the step atomically (a crash mid-write leaves
    the previous checkpoint), and the next save, restore or close waits for it first.
    """

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = False):
        self.directory = os.path.abspath(directory)
        self.async_save = async_save
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=async_save
            ),
        )

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state: nnx.State, meta: dict, groups: dict | None = None) -> None:
        """Checkpoints `step`: written before returning, or (async_save) in the background.

        The groups file is written first, synchronously; it counts only once Orbax commits the
        step, and files of steps Orbax no longer keeps are removed.
        """
        if step in self.manager.all_steps():  # a newer state of the same version replaces it
            self.manager.wait_until_finished()
            self.manager.delete(step)
        primary = distributed.is_primary()
        if groups is not None and primary:
            save_groups(os.path.join(self.directory, f"groups_{step}.npz"), groups)
        pure = state.to_pure_dict()
        self.manager.save(  # waits for a save still in flight first
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(pure[0]),
                optimizer=ocp.args.StandardSave(pure[1]),
                meta=ocp.args.JsonSave(meta),
                layout=ocp.args.JsonSave(layout()),
            ),
        )
        if not self.async_save:
            self.manager.wait_until_finished()
        keep = set(self.manager.all_steps()) | {step}
        for name in os.listdir(self.directory) if primary else ():  # retention follows Orbax's
            if name.startswith("groups_") and name.endswith(".npz"):
                if int(name[len("groups_") : -len(".npz")]) not in keep:
                    os.remove(os.path.join(self.directory, name))

    def wait(self) -> None:
        """Returns once no save is in flight (the newest step is committed)."""
        self.manager.wait_until_finished()

    def restore(self, state: nnx.State, step: int | None = None):
        """(state, meta, groups) of `step` (default latest); arrays keep `state`'s shardings."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state.to_pure_dict())
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(target[0]),
                    optimizer=ocp.args.StandardRestore(target[1]),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(self._misfit(step, e)) from e
        nnx.replace_by_pure_dict(state, {0: restored["params"], 1: restored["optimizer"]})
        groups = load_groups(os.path.join(self.directory, f"groups_{step}.npz"))
        return state, restored["meta"], groups

    def _misfit(self, step: int, cause: BaseException) -> str:
        """Why checkpoint `step` does not restore here: the writers' layout and this one's."""
        try:
            args = ocp.args.Composite(layout=ocp.args.JsonRestore())
            saved = describe_layout(self.manager.restore(step, args=args)["layout"])
        except Exception:  # noqa: BLE001 - a checkpoint from before the layout item
            saved = "an unknown layout"
        why = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return (
            f"checkpoint {os.path.join(self.directory, str(step))} does not restore into this "
            f"learner: written by {saved}, restored by {describe_layout(layout())}; restore it "
            f"with the model it was written with (learner.hosts and learner.mesh may differ "
            f"when the arrays divide over the new mesh): {why}"
        )

    def close(self) -> None:
        """Waits for pending writes and closes the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def layout() -> dict:
    """This learner's process and device counts (written with each checkpoint)."""
    return {"hosts": jax.process_count(), "devices": jax.device_count()}


def describe_layout(lay: dict) -> str:
    """A layout item in words."""
    return f"{lay['hosts']} learner host(s) with {lay['devices']} device(s)"


def restore_params(directory: str, step: int | None = None) -> dict:
    """The model params of a checkpoint (only that item) as a pure dict of numpy arrays.

    Needs no learner: the parameter server and the exporter call it on any host.
    """
    mgr = ocp.CheckpointManager(os.path.abspath(directory))
    try:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {directory}")
        # Restore arguments from the item's own metadata: faster than StandardRestore() without
        # a target (docs/benchmarks.md, publication).
        meta = mgr.item_metadata(step)["params"]
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
        restored = mgr.restore(
            step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(restore_args=args))
        )
    finally:
        mgr.close()
    return jax.tree.map(np.asarray, restored["params"])
