"""Orbax checkpoints of the learner state plus everything a resumed run needs.

A checkpoint at version v holds: params and optimizer state (sharded arrays, StandardSave),
and a JSON `meta` item with the version, the stage, and the Coordinator's and GroupBuffer's
state() (data cursor, admission state, counters). Finished but untrained groups are written
next to it as `groups_<step>.npz` (the arrays of rl.types.groups_to_arrays), so a resumed run
loses no finished episode. A preemption's checkpoint also holds the groups that were still being
generated, as `partials_<step>.npz` (rl.partials): a resumed run continues them after their
saved tokens instead of generating them again.

A restore verifies what it reads: Orbax's commit markers, items Orbax can read, and the groups
and partials files' sha256 recorded in `meta`. A half-written or corrupt checkpoint is skipped
for the one before it, with a warning naming it; a failed write raises CheckpointError and
leaves the previous checkpoint as it was.

A learner over several hosts checkpoints from every process: each writes its own shards, Orbax's
primary (process 0) the metadata; the groups file and retention are process 0's. A `layout` item
records the writers' process and device counts, so a restore that cannot fit says so.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from rl import distributed
from rl.partials import PartialGroup, by_id, partials_from_arrays, partials_to_arrays
from rl.types import EpisodeGroup, groups_from_arrays, groups_to_arrays

COMMIT_MARKER = "commit_success.txt"  # Orbax's last file of a committed step and of each item
ITEMS = ("params", "optimizer", "meta")
GROUPS_SHA = "groups_sha256"  # the meta key holding the groups file's digest (None: no file)
PARTIALS_SHA = "partials_sha256"  # the same for the partials file


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint under a directory is valid."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on restore (half-written or corrupt)."""


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes (groups files here; the parameter server's manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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


def save_partials(path: str, partials: Mapping[int, PartialGroup] | Iterable[PartialGroup]) -> None:
    """Writes partial groups to an npz of partials_to_arrays' arrays (temporary file, renamed)."""
    if isinstance(partials, Mapping):
        partials = partials.values()
    tmp = path + ".tmp.npz"
    np.savez(tmp, **partials_to_arrays(list(partials)))
    os.replace(tmp, path)


def load_partials(path: str) -> dict[int, PartialGroup]:
    """{group number: PartialGroup} of a save_partials file ({} if there is none); no pickle."""
    if not os.path.exists(path):
        return {}
    with np.load(path, allow_pickle=False) as z:
        return by_id(partials_from_arrays({k: z[k] for k in z.files}))


class Invalid(Exception):
    """What is wrong with one checkpoint (restore skips it for the one before)."""


class Checkpointer:
    """Saves and restores (learner state, meta, buffered groups) under run_dir/checkpoints.

    With async_save the learner waits only while the arrays are copied off its devices; Orbax
    writes them in the background and commits the step atomically (a crash mid-write leaves
    the previous checkpoint), and the next save, restore or close waits for it first.
    """

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = False):
        self.directory = os.path.abspath(directory)
        self.async_save = async_save
        self.in_flight: int | None = None  # the step an async save is writing
        self.failed: set[int] = set()  # steps whose save failed: their leftovers go at close
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=async_save
            ),
        )

    def step_dir(self, step: int) -> str:
        """The directory of checkpoint `step`."""
        return os.path.join(self.directory, str(step))

    def groups_path(self, step: int) -> str:
        """The groups file of checkpoint `step`."""
        return os.path.join(self.directory, f"groups_{step}.npz")

    def partials_path(self, step: int) -> str:
        """The partials file of checkpoint `step` (groups in flight at a preemption)."""
        return os.path.join(self.directory, f"partials_{step}.npz")

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self.manager.latest_step()

    def save(
        self,
        step: int,
        state: nnx.State,
        meta: dict,
        groups: dict | None = None,
        partials: Mapping[int, PartialGroup] | None = None,
    ) -> None:
        """Checkpoints `step`: written before returning, or (async_save) in the background.

        The groups file (and the partials file, if there are partial groups) is written first,
        synchronously, and its sha256 goes into meta; it counts only once Orbax commits the
        step, and once it has, files of steps Orbax no longer keeps are removed. A write that
        fails raises CheckpointError (an async one at the next save, wait or close); earlier
        checkpoints stay valid.
        """
        self.wait()  # a background save that failed is reported before this one starts
        try:
            if step in self.manager.all_steps():  # a newer state of the same version replaces it
                self.manager.delete(step)
            meta = {**meta, GROUPS_SHA: None}
            path = self.groups_path(step)
            if groups is not None:
                if distributed.is_primary():  # Orbax writes meta from the primary alone
                    save_groups(path, groups)
                    meta[GROUPS_SHA] = sha256_file(path)
            elif os.path.exists(path) and distributed.is_primary():
                os.remove(path)
            meta[PARTIALS_SHA] = None
            path = self.partials_path(step)
            if partials:
                if distributed.is_primary():
                    save_partials(path, partials)
                    meta[PARTIALS_SHA] = sha256_file(path)
            elif os.path.exists(path) and distributed.is_primary():
                os.remove(path)
            pure = state.to_pure_dict()
            self.in_flight = step
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(pure[0]),
                    optimizer=ocp.args.StandardSave(pure[1]),
                    meta=ocp.args.JsonSave(meta),
                    layout=ocp.args.JsonSave(layout()),
                ),
            )
        except OSError as e:
            raise self._failed(step, e) from e
        if not self.async_save:
            self.wait()

    def _failed(self, step: int | None, error: BaseException) -> CheckpointError:
        """Removes what a failed save of `step` left; the error naming it and what is kept."""
        self.in_flight = None
        if step is not None:
            self.failed.add(step)
            self._remove_leftovers(step)
        kept = sorted(self.manager.all_steps())
        return CheckpointError(
            f"checkpoint {self.step_dir(step) if step is not None else self.directory} was not "
            f"written: {type(error).__name__}: {error}; "
            f"committed checkpoints kept: {kept or 'none'}"
        )

    def _remove_leftovers(self, step: int) -> None:
        """Removes the temporary directory and files a failed save of an uncommitted step left."""
        if step in self.manager.all_steps():
            return
        for left in glob.glob(self.step_dir(step) + ".orbax-checkpoint-tmp*"):
            shutil.rmtree(left, ignore_errors=True)
        for path in (self.groups_path(step), self.partials_path(step)):
            if os.path.exists(path):
                os.remove(path)

    def wait(self) -> None:
        """Returns once no save is in flight (the newest step is committed); raises
        CheckpointError if that save failed."""
        try:
            self.manager.wait_until_finished()
        except OSError as e:
            raise self._failed(self.in_flight, e) from e
        self.in_flight = None
        for name in os.listdir(self.directory) if distributed.is_primary() else ():
            # retention follows Orbax's, once it committed
            for prefix in ("groups_", "partials_"):
                if name.startswith(prefix) and name.endswith(".npz"):
                    number = name[len(prefix) : -len(".npz")]
                    if number.isdigit() and not os.path.isdir(self.step_dir(int(number))):
                        os.remove(os.path.join(self.directory, name))

    def restore(self, state: nnx.State, step: int | None = None, *, partials: bool = False):
        """(state, meta, groups) of `step` (default: the newest valid); arrays keep `state`'s
        shardings; with partials=True (state, meta, groups, partial groups). A newest checkpoint
        that is half-written or corrupt is skipped with a CheckpointWarning naming it;
        CheckpointError if none is valid (or `step` is not)."""
        self.wait()
        self.manager.reload()  # every step on disk, also one a failed save left undeleted
        steps = sorted(self.manager.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state.to_pure_dict())
        problems = []
        for s in steps:
            try:
                restored, groups, parts = self._read(s, target)
            except Invalid as e:
                problems.append(f"{self.step_dir(s)}: {e}")
                if s != steps[-1]:
                    warnings.warn(
                        f"checkpoint {self.step_dir(s)} skipped: {e}; trying the one before it",
                        CheckpointWarning,
                        stacklevel=2,
                    )
                continue
            nnx.replace_by_pure_dict(state, {0: restored["params"], 1: restored["optimizer"]})
            meta = dict(restored["meta"])
            meta.pop(GROUPS_SHA, None)
            meta.pop(PARTIALS_SHA, None)
            return (state, meta, groups, parts) if partials else (state, meta, groups)
        raise CheckpointError("no valid checkpoint: " + "; ".join(problems))

    def _read(self, step: int, target):
        """(Orbax's restored items, groups) of a verified `step`; raises Invalid saying why not."""
        d = self.step_dir(step)
        markers = [os.path.join(d, COMMIT_MARKER)]
        markers += [os.path.join(d, item, COMMIT_MARKER) for item in ITEMS]
        missing = [os.path.relpath(m, d) for m in markers if not os.path.exists(m)]
        if missing:
            raise Invalid(f"not committed (no {', '.join(missing)})")
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(target[0]),
                    optimizer=ocp.args.StandardRestore(target[1]),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # noqa: BLE001 - any unreadable item makes the step invalid
            if self._per_layer(step, target[0]):
                raise ValueError(
                    f"checkpoint {self.step_dir(step)} holds one parameter per decoder layer "
                    f"(model.layers.<i>.*), written before the layers were stacked; this model "
                    f"stacks them (model.layers.* with a leading layers axis), so it does not "
                    f"restore here: export it to HF with the code that wrote it, then import it"
                ) from e
            if self._misfits(step):  # not corrupt: no checkpoint here fits this learner
                raise ValueError(self._misfit(step, e)) from e
            raise Invalid(f"unreadable: {type(e).__name__}: {str(e)[:300]}") from e
        groups = self._verified(step, restored["meta"], GROUPS_SHA, self.groups_path(step))
        parts = self._verified(step, restored["meta"], PARTIALS_SHA, self.partials_path(step))
        return restored, groups, parts

    def _verified(self, step: int, meta: Mapping, key: str, path: str) -> dict:
        """The groups or partials file of `step` whose sha256 meta[key] recorded, loaded ({}
        when meta records none); raises Invalid if it is missing, altered or unreadable."""
        want = meta.get(key, "unrecorded")  # unrecorded: an older writer
        if want is None:
            return {}
        if want != "unrecorded":
            if not os.path.exists(path):
                raise Invalid(f"its {key.split('_')[0]} file {path} is missing")
            got = sha256_file(path)
            if got != want:
                raise Invalid(
                    f"its {key.split('_')[0]} file {path} has sha256 {got}, recorded {want}"
                )
        try:
            return load_groups(path) if key == GROUPS_SHA else load_partials(path)
        except Exception as e:  # noqa: BLE001
            raise Invalid(
                f"its {key.split('_')[0]} file {path} is unreadable: {type(e).__name__}: {e}"
            ) from e

    def _per_layer(self, step: int, target_params) -> bool:
        """Whether `step` holds per-layer decoder params (model.layers.<i>) the target stacks."""
        try:
            saved = self.manager.item_metadata(step)["params"]["model"]["layers"]
            wanted = target_params["model"]["layers"]
        except Exception:  # noqa: BLE001 - no such params tree: not this misfit
            return False
        digits = lambda tree: bool(tree) and all(str(k).isdigit() for k in tree)
        return digits(saved) and not digits(wanted)

    def _misfits(self, step: int) -> bool:
        """Whether `step` was written by a learner of another layout (hosts, devices)."""
        try:
            args = ocp.args.Composite(layout=ocp.args.JsonRestore())
            return self.manager.restore(step, args=args)["layout"] != layout()
        except Exception:  # noqa: BLE001 - before the layout item, or unreadable: not a misfit
            return False

    def _misfit(self, step: int, cause: BaseException) -> str:
        """Why checkpoint `step` does not restore here: the writers' layout and this one's."""
        try:
            args = ocp.args.Composite(layout=ocp.args.JsonRestore())
            saved = describe_layout(self.manager.restore(step, args=args)["layout"])
        except Exception:  # noqa: BLE001 - a checkpoint from before the layout item
            saved = "an unknown layout"
        why = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return (
            f"checkpoint {self.step_dir(step)} does not restore into this learner: written by "
            f"{saved}, restored by {describe_layout(layout())}; restore it with the model it was "
            f"written with (learner.hosts and learner.mesh may differ when the arrays divide over "
            f"the new mesh): {why}"
        )

    def close(self) -> None:
        """Waits for pending writes and closes the manager; then, with Orbax's threads done,
        removes again what failed saves left (a writer of theirs can outlast the failure)."""
        try:
            self.wait()
        finally:
            self.manager.close()
            for step in sorted(self.failed):
                self._remove_leftovers(step)


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


class ParamReader:
    """One parameter of a checkpoint, read on demand straight from Orbax's tensorstore files."""

    def __init__(self, spec: dict, shape: tuple[int, ...], dtype: np.dtype, context):
        self.spec, self.shape, self.dtype, self._context = spec, shape, dtype, context

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def read(self) -> np.ndarray:
        """The array (a new C-contiguous host array); safe to call from many threads."""
        import tensorstore as ts

        store = ts.open(self.spec, open=True, context=self._context).result()
        return np.asarray(store.read().result())


def open_params(directory: str, step: int | None = None) -> dict[tuple[str, ...], ParamReader]:
    """{param path: ParamReader} of a checkpoint's params item, nothing read yet.

    Publication reads each parameter in parallel with writing the last one instead of restoring
    the whole item first (rl.param_server). Checkpoints in a layout this does not know raise
    ValueError; restore_params reads any.
    """
    import json

    import tensorstore as ts

    mgr = ocp.CheckpointManager(os.path.abspath(directory))
    try:
        step = mgr.latest_step() if step is None else step
    finally:
        mgr.close()
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {directory}")
    item = os.path.join(os.path.abspath(directory), str(step), "params")
    with open(os.path.join(item, "_METADATA")) as f:
        meta = json.load(f)
    if not meta.get("use_ocdbt", False):
        raise ValueError(f"{item}: not an OCDBT checkpoint item")
    driver = "zarr3" if meta.get("use_zarr3", False) else "zarr"
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    kvstore = {"driver": "ocdbt", "base": f"file://{item}"}
    readers = {}
    for entry in meta["tree_metadata"].values():
        path = tuple(str(k["key"]) for k in entry["key_metadata"])
        spec = {"driver": driver, "kvstore": kvstore, "path": ".".join(path)}
        store = ts.open(spec, open=True, context=context).result()
        readers[path] = ParamReader(
            spec, tuple(store.shape), np.dtype(store.dtype.numpy_dtype), context
        )
    return readers
