"""The learner: an nnx model + optax optimizer, a jit-sharded train step with donation,
micro-batch gradient accumulation, and sequence packing; and THE learner contract
(LearnerHandle) that it, the lockstep leader and the Ray learner client keep."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import sharding as msh
from models.attention import segment_lengths
from rl import distributed, startup
from rl.algorithms import losses as L
from rl.logprobs import token_logprobs
from rl.rollout.base import Weights
from rl.types import Episode, TrainBatch


class LearnerLost(RuntimeError):
    """The learner's process died; a new one can start from the last checkpoint."""


class LearnerHandle(Protocol):
    """THE learner contract: what the trainer and the warm start call, wherever the learner runs.

    Implemented by Learner (this process, with its Checkpointer), rl.lockstep.Leader (this
    process leading the other learner hosts) and rl.ray.learner.RemoteLearner (the Ray learner
    actors' client); rl/build.py start_learner picks one, so the trainer never asks which.
    """

    version: int  # updates applied (the policy version); the warm start sets it
    restarts: int  # times the learner was replaced from its last checkpoint

    @property
    def config(self): ...  # the model's config

    def update(
        self, batch: TrainBatch, *, minibatches: int = 1, wait: bool = True
    ) -> dict[str, float]:
        """One policy update; the loss metrics (wait=False: may return before the step ends,
        the metrics as arrays; an implementation may always wait)."""

    def set_step_cfg(self, cfg: StepConfig) -> None:
        """Switches the compiled step (warm start / RL)."""

    def reset_optimizer(self, tx: optax.GradientTransformation) -> None:
        """A fresh optimizer state (the run's own optimizers, rl/learner_setup.py)."""

    def weights(self) -> Weights:
        """The current params, as the engines take them."""

    def save(self, step: int, meta: dict, groups=None, partials=None) -> None:
        """Checkpoint `step`: learner state, `meta`, buffered groups, partial groups."""

    def wait_saved(self) -> None:
        """Returns once the last checkpoint is committed; a write that failed raises."""

    def restore(self) -> tuple[dict, dict, dict] | None:
        """Loads the newest checkpoint: (meta, groups, partial groups), or None if none."""

    def restart(self, why: str) -> None:
        """Replaces a lost learner (LearnerLost) by one on the newest valid checkpoint."""

    def stats(self) -> dict[str, float]:
        """Counters for the update's metrics row."""

    def close(self, failed: bool = False) -> None:
        """Waits for checkpoint writes and releases the learner (`failed`: the run failed)."""


# ---------------------------------------------------------------------------------------------
# Batches


def bucket(n: int, multiple: int = 16) -> int:
    """Rounds n up to a multiple (shape buckets keep the number of compilations small)."""
    return max(multiple, -(-n // multiple) * multiple)


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Packs sequences of `lengths` into rows of row_len tokens (first-fit decreasing)."""
    rows: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(space):
            if free >= lengths[i]:
                rows[r].append(i)
                space[r] -= lengths[i]
                break
        else:
            rows.append([i])
            space.append(row_len - lengths[i])
    return rows


def make_batch(
    episodes: Sequence[Episode],
    advantages: Sequence[float],
    *,
    num_rows: int | None = None,
    row_len: int | None = None,
    pack: bool = False,
) -> TrainBatch:
    """Builds a TrainBatch from episodes: one row per episode, or packed rows of `row_len` tokens.

    Rows beyond the episodes are padding (loss mask 0), so batches keep a fixed shape.
    """
    lengths = [len(e.tokens) - 1 for e in episodes]
    if row_len is None:
        row_len = bucket(max(lengths) if lengths else 1)
    if max(lengths, default=0) > row_len:
        raise ValueError(f"episode of {max(lengths)} targets does not fit row_len={row_len}")
    rows = pack_rows(lengths, row_len) if pack else [[i] for i in range(len(episodes))]
    if num_rows is None:
        num_rows = len(rows)
    if len(rows) > num_rows:
        raise ValueError(f"{len(episodes)} episodes need {len(rows)} rows, batch has {num_rows}")
    shape = (num_rows, row_len)
    out = {
        "inputs": np.zeros(shape, np.int32),
        "targets": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "behavior_logp": np.zeros(shape, np.float32),
        "advantages": np.zeros(shape, np.float32),
        "versions": np.full(shape, -1, np.int32),
    }
    for r, members in enumerate(rows):
        col = 0
        for seg, i in enumerate(members, start=1):
            e, n = episodes[i], lengths[i]
            s = slice(col, col + n)
            out["inputs"][r, s] = e.tokens[:-1]
            out["targets"][r, s] = e.tokens[1:]
            out["positions"][r, s] = np.arange(n)
            out["segment_ids"][r, s] = seg
            out["loss_mask"][r, s] = e.loss_mask[1:]
            out["behavior_logp"][r, s] = e.behavior_logp[1:]
            out["advantages"][r, s] = advantages[i]
            out["versions"][r, s] = np.where(e.loss_mask[1:] > 0, e.versions[1:], -1)
            col += n
    return TrainBatch(**out, num_sequences=len(episodes))


def train_batch(
    episodes: Sequence[Episode], advantages, *, row_len: int, pack: bool, unit: int, rows: int
) -> TrainBatch:
    """An update's TrainBatch: `rows` rows of one episode each, or packed rows.

    Packed, the row count is rounded up to `unit` x a power of two (unit = minibatches x
    micro-batches x data-parallel size, so every split is even): a handful of shapes, so a
    handful of compilations, however the lengths vary.
    """
    if not pack:
        return make_batch(episodes, advantages, num_rows=rows, row_len=row_len)
    longest = max(len(e.tokens) - 1 for e in episodes)
    if longest > row_len:
        raise ValueError(
            f"learner.pack_length: invalid value {row_len}; an episode has {longest} "
            f"targets (raise pack_length or lower rollout.max_new_tokens)"
        )
    n = len(pack_rows([len(e.tokens) - 1 for e in episodes], row_len))
    num_rows = unit * 2 ** max(0, int(np.ceil(np.log2(-(-n // unit)))))
    return make_batch(episodes, advantages, num_rows=num_rows, row_len=row_len, pack=True)


# ---------------------------------------------------------------------------------------------
# Optimizer


def make_schedule(
    lr: float, *, total_steps: int, warmup_steps: int = 0, schedule: str = "constant"
) -> optax.Schedule:
    """Linear warmup, then constant or cosine decay (to lr / 10) over total_steps."""
    if schedule == "cosine":
        warmup = min(warmup_steps, max(total_steps - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            0.0 if warmup else lr, lr, warmup, max(total_steps, warmup + 1), lr * 0.1
        )
    if warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)],
            [warmup_steps],
        )
    return optax.constant_schedule(lr)


def make_optimizer(
    lr: float | optax.Schedule,
    *,
    total_steps: int = 0,
    warmup_steps: int = 0,
    schedule: str = "constant",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-8,
    max_grad_norm: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW (a float lr with warmup + schedule, or a schedule) after global-norm clipping."""
    if callable(lr):
        sched = lr
    else:
        sched = make_schedule(
            lr, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule
        )
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


# ---------------------------------------------------------------------------------------------
# Learner


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the compiled step (hashable)."""

    loss: str = "ppo_clip"
    loss_cfg: L.LossConfig = L.LossConfig()
    temperature: float = 1.0
    micro_batches: int = 1
    logprob_chunk: int = 0
    needs_proximal: bool = False


def policy_logprobs(model, b: dict, cfg: StepConfig):
    """(log p(target), entropy) [B, T] of a batch under `model` at the step's temperature, in
    the model's matmul precision."""
    with jax.default_matmul_precision(model.config.precision):
        h = model.hidden_states(
            b["inputs"], b["positions"], b.get("segment_ids"), b.get("segment_lengths")
        )
        return token_logprobs(
            h, model.lm_head_kernel(), b["targets"], cfg.temperature, cfg.logprob_chunk
        )


def _batch_sharding(mesh):
    return msh.logical_sharding(mesh, ("batch", None))


# How per-micro-batch metrics combine: sums (losses are normalised by the GLOBAL counts, so their
# micro-batch values add up), maxima, and everything else a token mean over the micro-batch's
# trained tokens (re-weighted by its token count, then divided by the global count).
_SUMMED = ("loss", "pg_loss", "entropy", "logp_sum", "num_tokens")
_MAXED = ("ratio_max",)


def _token_level(cfg: StepConfig) -> bool:
    """Whether the loss only sums per-token terms (then packed rows are exact)."""
    return L.token_level(cfg.loss, cfg.loss_cfg)


class Learner:
    """Owns the policy and optimizer state on a mesh and applies updates; version = updates."""

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        mesh=None,
        step_cfg: StepConfig = StepConfig(),
        version: int = 0,
        ckpt=None,
        gemm_autotune: bool = False,
    ):
        """ckpt: the Checkpointer its save / restore go through (rl.checkpoint);
        gemm_autotune: trainer.gemm_autotune (XLA's autotuned GEMMs on a GPU)."""
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        mesh = mesh if mesh is not None else msh.make_mesh(devices=jax.devices()[:1])
        self._adopt(graphdef, state, model.config, mesh, step_cfg, version, ckpt, gemm_autotune)

    @classmethod
    def abstract(
        cls,
        config,
        tx: optax.GradientTransformation,
        *,
        mesh,
        step_cfg: StepConfig = StepConfig(),
        gemm_autotune: bool = False,
    ) -> Learner:
        """A learner of `config`'s shapes on `mesh` whose state is shapes and shardings only,
        nothing allocated: lower_update compiles its step for a model of any size on any mesh
        (launch.bench layout's checks on fake devices). It cannot update."""
        from models.transformer import Transformer

        def build():
            model = Transformer(config, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        graphdef, state = nnx.split(nnx.eval_shape(build))
        shardings = msh.state_shardings(config, state, mesh)  # moments: their param's
        state = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, shardings
        )
        learner = cls.__new__(cls)
        learner._adopt(graphdef, state, config, mesh, step_cfg, 0, None, gemm_autotune)
        return learner

    def _adopt(self, graphdef, state, config, mesh, step_cfg, version, ckpt, gemm_autotune):
        self.ckpt = ckpt
        self.mesh = mesh
        platform = self.mesh.devices.flat[0].platform
        self.compiler_options = startup.gemm_options(gemm_autotune, platform)
        self.step_cfg = step_cfg
        self.version = version
        self.graphdef = graphdef
        self._native_segments = config.attention_impl == "cudnn"
        # Optimizer moments are zeros_like(param) and keep its sharding; scalars (step counts)
        # and anything left on a single device are replicated over the mesh.
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

        def place(x):
            if isinstance(x, jax.Array) and not isinstance(x.sharding, jax.sharding.NamedSharding):
                return jax.device_put(x, replicated)
            return x

        self.state = jax.tree.map(place, state)
        self.state_sharding = jax.tree.map(lambda x: x.sharding, self.state)
        self.traces = 0  # update and log-prob programs traced (compilations), for benches
        self._train = self._compile_train(step_cfg)
        self._logp = None

    # -- model access ---------------------------------------------------------------------
    @property
    def model(self) -> nnx.Module:
        """The current model (a view that shares the learner's arrays)."""
        model, _ = nnx.merge(self.graphdef, self.state)
        return model

    @property
    def config(self):
        """The model's config."""
        return self.model.config

    def params(self) -> nnx.State:
        """The current parameters (nnx.Param state)."""
        return nnx.state(self.model, nnx.Param)

    def weights(self) -> Weights:
        """The current parameters as the engines' Weights."""
        return Weights(params=self.params())

    # -- compiled functions ---------------------------------------------------------------
    def _compile_train(self, cfg: StepConfig):
        graphdef = self.graphdef
        batch_sharding = _batch_sharding(self.mesh)
        spec = L.loss_spec(cfg.loss)

        def loss_fn(model, b, num_tokens, num_seqs):
            logp, entropy = policy_logprobs(model, b, cfg)
            prox = b.get("proximal_logp")
            if prox is None and cfg.needs_proximal:
                prox = jax.lax.stop_gradient(logp)  # one minibatch: params at update start
            inputs = L.LossInputs(
                logp=logp,
                behavior_logp=b["behavior_logp"],
                advantages=b["advantages"],
                mask=b["loss_mask"],
                proximal_logp=prox,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            loss, metrics = L.compute_loss(cfg.loss, inputs, cfg.loss_cfg)
            if spec.supervised:  # the warm start reports its NLL only
                metrics = {"loss": metrics["loss"]}
            m = b["loss_mask"]
            metrics["entropy"] = (jax.lax.stop_gradient(entropy) * m).sum()
            metrics["logp_sum"] = (jax.lax.stop_gradient(logp) * m).sum()
            return loss, metrics

        def step(state, batch):
            self.traces += 1
            model, optimizer = nnx.merge(graphdef, state)
            m = batch["loss_mask"]
            num_tokens = m.sum()
            num_seqs = (m.sum(-1) > 0).sum().astype(jnp.float32)
            n_micro = cfg.micro_batches
            micro = jax.tree.map(lambda x: x.reshape(n_micro, -1, *x.shape[1:]), batch)
            model_def, params, rest = nnx.split(model, nnx.Param, ...)

            def grad_one(b):
                def f(p):
                    return loss_fn(nnx.merge(model_def, p, rest), b, num_tokens, num_seqs)

                (loss, met), g = jax.value_and_grad(f, has_aux=True)(params)
                n_local = b["loss_mask"].sum()
                met = {k: v if k in _SUMMED + _MAXED else v * n_local for k, v in met.items()}
                return loss, met, g

            if n_micro == 1:
                loss, met, grads = grad_one(jax.tree.map(lambda x: x[0], micro))
            else:

                def acc(carry, b):
                    loss, met, g = grad_one(b)
                    c_loss, c_met, c_g = carry
                    c_met = {
                        k: jnp.maximum(c_met[k], v) if k in _MAXED else c_met[k] + v
                        for k, v in met.items()
                    }
                    return (c_loss + loss, c_met, jax.tree.map(jnp.add, c_g, g)), None

                zeros = jax.tree.map(
                    jnp.zeros_like, jax.eval_shape(grad_one, jax.tree.map(lambda x: x[0], micro))
                )
                (loss, met, grads), _ = jax.lax.scan(acc, zeros, micro)
                met["loss"] = loss
            met = {
                k: v if k in _SUMMED + _MAXED else v / jnp.maximum(num_tokens, 1.0)
                for k, v in met.items()
            }
            grad_norm = optax.tree.norm(grads)
            optimizer.update(model, grads)
            met["grad_norm"] = grad_norm
            met["entropy"] = met["entropy"] / jnp.maximum(num_tokens, 1.0)
            met["logp_mean"] = met.pop("logp_sum") / jnp.maximum(num_tokens, 1.0)
            return nnx.state((model, optimizer)), met

        return jax.jit(
            step,
            in_shardings=(self.state_sharding, batch_sharding),
            out_shardings=(self.state_sharding, None),
            donate_argnums=(0,),
            compiler_options=self.compiler_options,
        )

    def _compile_logp(self):
        graphdef = self.graphdef
        cfg = self.step_cfg

        def logp(state, b):
            self.traces += 1
            model, _ = nnx.merge(graphdef, state)
            return policy_logprobs(model, b, cfg)[0]

        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.jit(
            logp,
            in_shardings=(self.state_sharding, _batch_sharding(self.mesh)),
            out_shardings=replicated,  # every host reads the whole [B, T] back
            compiler_options=self.compiler_options,
        )

    # -- public ---------------------------------------------------------------------------
    def program_key(self, batch: TrainBatch) -> tuple:
        """What selects the compiled update program for `batch`: its packed shape, and with
        cuDNN attention its segment count (a shape there too)."""
        arrays = batch.arrays()
        key = tuple(arrays["inputs"].shape)
        if self._native_segments and "segment_ids" in arrays:
            key += tuple(segment_lengths(arrays["segment_ids"]).shape)
        return key

    def _device_batch(self, batch: TrainBatch | dict) -> dict:
        """The batch on the mesh. Every process holds the whole host batch (the trainer's, or
        the object store's copy on each learner host) and places only its devices' rows: the
        global shape is the local one, so no host needs to know the others' slices."""
        arrays = batch.arrays() if isinstance(batch, TrainBatch) else dict(batch)
        arrays.pop("versions", None)
        if self._native_segments and "segment_ids" in arrays:  # cuDNN: segments, no mask
            arrays["segment_lengths"] = segment_lengths(arrays["segment_ids"])
        sharding = _batch_sharding(self.mesh)
        return {
            k: jax.make_array_from_process_local_data(sharding, np.asarray(v), np.shape(v))
            for k, v in arrays.items()
        }

    def logprobs(self, batch: TrainBatch) -> np.ndarray:
        """log p(target) [B, T] under the current params (at the learner's temperature)."""
        if self._logp is None:
            self._logp = self._compile_logp()
        with jax.set_mesh(self.mesh):  # traced in the mesh: attention's sharding constraints
            out = self._logp(self.state, self._device_batch(batch))
        out = distributed.wait(out, "logprobs")
        return np.asarray(out)

    def update(
        self, batch: TrainBatch, *, minibatches: int = 1, wait: bool = True
    ) -> dict[str, float]:
        """One policy update on a batch (split into `minibatches` optimizer steps). With
        wait=False (one minibatch, one host) the metrics stay on the device and the step is not
        waited for: a loop that reads them rarely prepares the next batch while it runs."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        for mb in self._minibatches(batch, minibatches):
            with jax.set_mesh(self.mesh):  # traced in the mesh: attention's sharding constraints
                self.state, met = self._train(self.state, self._device_batch(mb))
            if not wait and minibatches == 1 and jax.process_count() == 1:
                self.version += 1
                return met
            met = distributed.wait(met, "update")  # a lost learner host fails, not hangs
            for k, v in met.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / minibatches
        self.version += 1
        metrics["timing/train_step"] = time.perf_counter() - t0
        return metrics

    def warm(self, batch: TrainBatch, *, minibatches: int = 1) -> None:
        """Compiles the programs an update of `batch`'s shapes runs, leaving the state as it was:
        the step runs once on a copy of the state and its result is dropped (benchmarks warm
        every packed row count before a timed window)."""
        mb = self._minibatches(batch, minibatches)[0]
        copy = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, self.state)
        with jax.set_mesh(self.mesh):
            out = self._train(copy, self._device_batch(mb))
        jax.block_until_ready(out)

    def _minibatches(self, batch: TrainBatch | dict, minibatches: int) -> list[dict]:
        """The update's host minibatches (checked; with the proximal log-probs of the params at
        the update's start when the loss needs them across several minibatches)."""
        arrays_in = batch.arrays() if isinstance(batch, TrainBatch) else batch
        segment_ids = arrays_in.get("segment_ids")  # absent: unpacked rows, no segment mask
        packed = segment_ids is not None and np.max(segment_ids) > 1
        if packed and not _token_level(self.step_cfg):
            c = self.step_cfg
            seq = " (a sequence-level loss)" if L.loss_spec(c.loss).sequence_level else ""
            raise ValueError(
                f"a packed batch (rows hold several sequences) needs a token-level loss, got "
                f"loss={c.loss!r}{seq}, aggregation={c.loss_cfg.aggregation!r}, "
                f"is_correction={c.loss_cfg.is_correction!r}; use aggregation='token_mean' (and "
                f"a token-level loss, no *_seq correction) or learner.pack=false"
            )
        arrays = dict(arrays_in)
        if self.step_cfg.needs_proximal and minibatches > 1:
            arrays["proximal_logp"] = self.logprobs(batch)  # the params at the update's start
        B = arrays["inputs"].shape[0]
        if B % minibatches:
            raise ValueError(f"batch of {B} rows does not split into {minibatches} minibatches")
        per = B // minibatches  # sliced on host, then placed with the batch sharding
        return [
            {k: np.asarray(v)[i * per : (i + 1) * per] for k, v in arrays.items()}
            for i in range(minibatches)
        ]

    def lower_update(self, batch: TrainBatch | dict) -> jax.stages.Lowered:
        """The update step lowered for `batch`'s shapes, not run (compile-time benchmarks)."""
        with jax.set_mesh(self.mesh):
            return self._train.lower(self.state, self._device_batch(batch))

    def set_step_cfg(self, cfg: StepConfig) -> None:
        """Switches the compiled step (e.g. from the supervised stage to RL)."""
        self.step_cfg = cfg
        self._train = self._compile_train(cfg)
        self._logp = None

    def reset_optimizer(self, tx: optax.GradientTransformation) -> None:
        """Replaces the optimizer (fresh moments), keeping params and version."""
        self.__init__(
            self.model,
            tx,
            mesh=self.mesh,
            step_cfg=self.step_cfg,
            version=self.version,
            ckpt=self.ckpt,
        )

    # -- checkpoints: the rest of the learner contract (LearnerHandle) -------------------------
    restarts = 0  # a learner in this process is never replaced

    def save(self, step: int, meta: dict, groups=None, partials=None) -> None:
        """Checkpoints `step`: the learner state with `meta`, buffered and partial groups."""
        self.ckpt.save(step, self.state, meta, groups, partials)

    def wait_saved(self) -> None:
        """Returns once the last checkpoint is committed; a write that failed raises."""
        self.ckpt.wait()

    def restore(self):
        """Loads the newest checkpoint: (meta, groups, partial groups), or None if none."""
        if self.ckpt.latest_step() is None:
            return None
        self.state, meta, groups, partials = self.ckpt.restore(self.state, partials=True)
        self.version = meta["version"]
        return meta, groups, partials

    def restart(self, why: str) -> None:
        """A learner in this process is not replaced: its loss ends the run."""
        raise RuntimeError(f"{why}; a learner in this process is not restarted")

    def stats(self) -> dict[str, float]:
        """The learner's counters for the update's metrics row (none here)."""
        return {}

    def close(self, failed: bool = False) -> None:
        """Waits for the checkpoint writes in flight."""
        if self.ckpt is not None:
            self.ckpt.close()
