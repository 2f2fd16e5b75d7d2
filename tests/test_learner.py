"""The learner: loss against a numpy reference, micro-batching, packing, sharding, donation, SFT."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import create_model, make_mesh, tiny
from models.sharding import shard_model
from rl.algorithms.losses import LossConfig
from rl.learner import Learner, StepConfig, make_batch, make_optimizer
from rl.types import Episode

# tiny() narrowed to one layer: the learner's logic is per step, not per layer, and each test
# compiles its own step. Dims stay divisible by the 2 x 2 mesh.
CONFIG = tiny(num_hidden_layers=1, hidden_size=64, intermediate_size=128, head_dim=16)
V = CONFIG.vocab_size
LENGTHS = (30, 12, 21, 9, 25, 17, 31, 14)  # 8 episodes, row_len 32


def _mesh1():
    return make_mesh(devices=jax.devices()[:1])


def _episodes(seed=0, lengths=LENGTHS):
    """Episodes with a prompt, generated tokens and an environment span (loss mask 0) inside."""
    rng = np.random.RandomState(seed)
    eps = []
    for i, n in enumerate(lengths):
        p = 3 + i % 4
        mask = np.zeros(n, np.int8)
        mask[p:] = 1
        if n > p + 8:
            mask[p + 3 : p + 6] = 0  # an observation in the middle
        eps.append(
            Episode(
                f"e{i}",
                rng.randint(0, V, n),
                mask,
                np.zeros(n, np.float32),
                np.where(mask > 0, 0, -1),
                p,
                reward=float(i % 3),
            )
        )
    return eps


def _advantages(n, seed=1):
    return np.random.RandomState(seed).standard_normal(n).astype(np.float32)


def _params_np(learner):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(learner.params()))


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


@pytest.fixture(scope="module")
def model_state():
    """The initial model every test starts from (copied per learner: steps donate buffers)."""
    return create_model(CONFIG, seed=0)


def _model(base, mesh=None):
    """A private copy of `base` (on one device, or sharded on `mesh` by the rules table)."""
    graphdef, state = nnx.split(base)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, copy=True), state))
    return shard_model(model, mesh) if mesh is not None else model


_forward = nnx.jit(lambda m, t: m(t))


def _numpy_token_logp(model, episodes):
    """log p(token_t | tokens_<t) per episode by full forward passes (no packing, no segments)."""
    L = 32
    tokens = np.zeros((len(episodes), L), np.int32)
    for b, e in enumerate(episodes):
        tokens[b, : len(e.tokens)] = e.tokens
    logits = np.asarray(_forward(model, jnp.asarray(tokens)), np.float64)
    out = []
    for b, e in enumerate(episodes):
        x = logits[b, : len(e.tokens) - 1]
        lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
        out.append(x[np.arange(len(x)), e.tokens[1:]] - lse)
    return out


def _with_behavior(episodes, logps, seed=2):
    """Episodes whose behavior log-probs are the true ones plus noise (some ratios clip)."""
    rng = np.random.RandomState(seed)
    out = []
    for e, lp in zip(episodes, logps):
        b = np.zeros(len(e.tokens), np.float32)
        b[1:] = lp + 0.3 * rng.standard_normal(len(lp))
        out.append(dataclasses.replace(e, behavior_logp=np.where(e.loss_mask > 0, b, 0.0)))
    return out


def _numpy_ppo_token_mean(logps, episodes, adv, eps=0.2):
    """PPO-clip token-mean loss in float64."""
    total, count = 0.0, 0
    for lp, e, a in zip(logps, episodes, adv):
        m = e.loss_mask[1:] > 0
        r = np.exp(lp - e.behavior_logp[1:])
        obj = np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)
        total += -(obj * m).sum()
        count += m.sum()
    return total / count


# ---------------------------------------------------------------------------------------------
# (a) gradient accumulation


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_equal_full_batch(model_state, aggregation):
    eps0 = _episodes()
    logps = _numpy_token_logp(_model(model_state), eps0)
    eps = _with_behavior(eps0, logps)
    adv = _advantages(len(eps))
    batch = make_batch(eps, adv, row_len=32)
    loss_cfg = LossConfig(aggregation=aggregation)
    results = {}
    for n_micro in (1, 4):
        learner = Learner(
            _model(model_state),
            optax.sgd(1.0),  # the parameter delta is minus the gradient
            mesh=_mesh1(),
            step_cfg=StepConfig(loss="ppo_clip", loss_cfg=loss_cfg, micro_batches=n_micro),
        )
        before = _params_np(learner)
        met = learner.update(batch)
        after = _params_np(learner)
        results[n_micro] = (jax.tree.map(lambda a, b: b - a, before, after), met)
    (g1, m1), (g4, m4) = results[1], results[4]
    assert max(jax.tree.leaves(jax.tree.map(lambda g: np.abs(g).max(), g1))) > 1e-3
    assert _max_diff(g1, g4) < 1e-5
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "logp_mean", "num_tokens"):
        assert abs(m1[k] - m4[k]) < 1e-5 * max(1.0, abs(m1[k])), (k, m1[k], m4[k])
    for k in ("clip_fraction", "approx_kl", "ratio_mean", "ratio_max", "is_weight_mean"):
        assert abs(m1[k] - m4[k]) < 1e-5, (k, m1[k], m4[k])
    assert m1["clip_fraction"] > 0.05  # the clip is exercised
    if aggregation == "token_mean":  # the loss itself against the float64 reference
        assert abs(m1["loss"] - _numpy_ppo_token_mean(logps, eps, adv)) < 1e-5


# ---------------------------------------------------------------------------------------------
# (b) packing


@pytest.mark.slow
def test_packed_batch_equals_unpacked(model_state):
    eps0 = _episodes(seed=3)
    logps = _numpy_token_logp(_model(model_state), eps0)
    eps = _with_behavior(eps0, logps)
    adv = _advantages(len(eps), seed=4)
    unpacked = make_batch(eps, adv, row_len=64)
    packed = make_batch(eps, adv, row_len=64, pack=True)
    assert packed.inputs.shape[0] < len(eps) and packed.segment_ids.max() >= 2
    assert packed.loss_mask.sum() == unpacked.loss_mask.sum()
    out = {}
    for name, batch in (("unpacked", unpacked), ("packed", packed)):
        learner = Learner(_model(model_state), optax.sgd(1.0), mesh=_mesh1())
        before = _params_np(learner)
        met = learner.update(batch)
        out[name] = (jax.tree.map(lambda a, b: b - a, before, _params_np(learner)), met)
    ref = _numpy_ppo_token_mean(logps, eps, adv)
    d_loss = abs(out["packed"][1]["loss"] - out["unpacked"][1]["loss"])
    assert d_loss < 1e-5
    assert abs(out["packed"][1]["loss"] - ref) < 1e-5
    assert _max_diff(out["packed"][0], out["unpacked"][0]) < 1e-5


@pytest.mark.slow
def test_traces_count_compilations_of_new_shapes(model_state):
    """Learner.traces (read by the async bench) counts one per new batch shape, none on reuse."""
    eps = _episodes(seed=3)
    adv = _advantages(len(eps), seed=4)
    learner = Learner(_model(model_state), optax.sgd(0.0), mesh=_mesh1())
    assert learner.traces == 0
    learner.update(make_batch(eps, adv, row_len=64))
    first = learner.traces
    assert first >= 1
    learner.update(make_batch(eps, adv, row_len=64))
    assert learner.traces == first
    learner.update(make_batch(eps, adv, row_len=128))
    assert learner.traces > first


@pytest.mark.slow
def test_warm_compiles_the_update_and_leaves_the_state(model_state):
    """Learner.warm (the async bench warms packed shapes with it) compiles what an update of the
    batch runs, on a copy of the state: params, optimizer and version stay as they were, and the
    update that follows traces nothing new and moves the params as one without warm does."""
    eps = _episodes(seed=3)
    adv = _advantages(len(eps), seed=4)
    batch = make_batch(eps, adv, row_len=64, pack=True)
    learner = Learner(_model(model_state), optax.adam(1e-2), mesh=_mesh1())
    before = jax.tree.map(np.asarray, learner.state)
    learner.warm(batch)
    assert learner.traces >= 1 and learner.version == 0
    assert _max_diff(before, jax.tree.map(np.asarray, learner.state)) == 0.0
    traces = learner.traces
    learner.update(batch)
    assert learner.traces == traces
    cold = Learner(_model(model_state), optax.adam(1e-2), mesh=_mesh1())
    cold.update(batch)
    assert _max_diff(_params_np(cold), _params_np(learner)) == 0.0


def test_warm_covers_an_update_with_proximal_logprobs(model_state):
    """With a proximal loss over two minibatches the update also feeds the log-probs of the
    params at its start: warm compiles that same program (and the log-prob one)."""
    eps = _episodes(seed=3)
    batch = make_batch(eps, _advantages(len(eps), seed=4), row_len=64)
    cfg = StepConfig(loss="decoupled_ppo", needs_proximal=True)
    learner = Learner(_model(model_state), optax.sgd(0.0), mesh=_mesh1(), step_cfg=cfg)
    learner.warm(batch, minibatches=2)
    traces = learner.traces
    learner.update(batch, minibatches=2)
    assert learner.traces == traces


def test_packed_logprobs_match_per_episode_forward(model_state):
    eps = _episodes(seed=5)
    logps = _numpy_token_logp(_model(model_state), eps)
    packed = make_batch(eps, np.zeros(len(eps)), row_len=64, pack=True)
    learner = Learner(_model(model_state), optax.sgd(0.0), mesh=_mesh1())
    lp = learner.logprobs(packed)
    # walk the packed rows: each segment is one episode, in the order make_batch placed them
    diffs = []
    for r in range(packed.inputs.shape[0]):
        for seg in range(1, packed.segment_ids[r].max() + 1):
            cols = np.nonzero(packed.segment_ids[r] == seg)[0]
            e = next(
                i
                for i, ep in enumerate(eps)
                if len(ep.tokens) - 1 == len(cols)
                and np.array_equal(ep.tokens[1:], packed.targets[r, cols])
            )
            diffs.append(np.abs(lp[r, cols] - logps[e]).max())
    assert len(diffs) == len(eps) and max(diffs) < 1e-5


def test_packed_batch_rejects_sequence_level_losses(model_state):
    eps = _episodes(seed=6)
    packed = make_batch(eps, np.zeros(len(eps)), row_len=64, pack=True)
    for step_cfg in (
        StepConfig(loss_cfg=LossConfig(aggregation="seq_mean_token_mean")),
        StepConfig(loss="gspo"),
    ):
        learner = Learner(_model(model_state), optax.sgd(0.0), mesh=_mesh1(), step_cfg=step_cfg)
        with pytest.raises(ValueError, match="packed"):
            learner.update(packed)


# ---------------------------------------------------------------------------------------------
# (c) one device vs a (fsdp=2, tensor=2) mesh


@pytest.mark.slow
def test_sharded_step_equals_single_device(model_state):
    """decoupled PPO with 2 minibatches x 2 micro-batches on the 2 x 2 mesh == two 1-device
    steps given the proximal log-probs of the params at the update's start (not of the params
    between minibatches); parameters stay sharded."""
    eps0 = _episodes(seed=12)
    eps = _with_behavior(eps0, _numpy_token_logp(_model(model_state), eps0))
    batch = make_batch(eps, _advantages(len(eps), seed=13), row_len=32)
    cfg = StepConfig(
        loss="decoupled_ppo",
        loss_cfg=LossConfig(decoupled_cap=5.0),
        micro_batches=2,
        needs_proximal=True,
    )
    mesh4 = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    sharded = Learner(_model(model_state, mesh=mesh4), optax.sgd(1.0), mesh=mesh4, step_cfg=cfg)
    shardings = jax.tree.map(lambda x: x.sharding, sharded.state)
    met = sharded.update(batch, minibatches=2)
    assert jax.tree.map(lambda x: x.sharding, sharded.state) == shardings

    ref = Learner(_model(model_state), optax.sgd(1.0), mesh=_mesh1(), step_cfg=cfg)
    arrays = batch.arrays()
    arrays["proximal_logp"] = ref.logprobs(batch)  # the update's start
    halves = [{k: v[i * 4 : (i + 1) * 4] for k, v in arrays.items()} for i in range(2)]
    ref_met = [ref.update(halves[0])]
    stale_prox = ref.logprobs(batch)[4:]  # what recomputing between minibatches would give
    ref_met.append(ref.update(halves[1]))

    assert _max_diff(_params_np(sharded), _params_np(ref)) < 1e-5
    assert np.abs(stale_prox - arrays["proximal_logp"][4:]).max() > 1e-3  # the check can fail
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "clip_fraction", "is_weight_mean"):
        want = (ref_met[0][k] + ref_met[1][k]) / 2  # update() averages its minibatches
        assert abs(met[k] - want) < 1e-5 * max(1.0, abs(want)), (k, met[k], want)
    # parameters really are split over the four devices
    q = sharded.params()["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]  # [L, D, N*H]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len({s.device for s in q.addressable_shards}) == 4
    assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // 2, q.shape[2] // 2)


def test_adam_state_sharded_and_old_state_donated(model_state):
    """(c) optimizer moments keep their parameter's sharding; (d) a step donates the old state."""
    mesh4 = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    learner = Learner(
        _model(model_state, mesh=mesh4), make_optimizer(1e-3, total_steps=10), mesh=mesh4
    )
    batch = make_batch(_episodes(seed=9), _advantages(8), row_len=32)
    learner.update(batch)  # compile
    params = jax.tree.leaves(learner.params())
    kernels = [x for x in jax.tree.leaves(learner.state) if x.ndim == 2]
    assert len(kernels) == 3 * len([p for p in params if p.ndim == 2])  # params, mu, nu
    specs = {x.sharding.spec for x in kernels}
    assert jax.sharding.PartitionSpec("fsdp", "tensor") in specs
    assert specs <= {p.sharding.spec for p in params if p.ndim == 2}

    old = jax.tree.leaves(learner.state)
    learner.update(batch)
    assert old and all(x.is_deleted() for x in old)
    assert not any(x.is_deleted() for x in jax.tree.leaves(learner.state))
    assert learner.version == 2


# ---------------------------------------------------------------------------------------------
# (e) supervised step


def test_sft_reduces_loss_and_matches_nll(model_state):
    eps = _episodes(seed=11)
    logps = _numpy_token_logp(_model(model_state), eps)
    batch = make_batch(eps, np.zeros(len(eps)), row_len=32)
    learner = Learner(
        _model(model_state),
        make_optimizer(3e-3, total_steps=20),
        mesh=_mesh1(),
        step_cfg=StepConfig(loss="sft", micro_batches=2),
    )
    losses = [learner.update(batch)["loss"] for _ in range(8)]
    nll = -sum((lp * (e.loss_mask[1:] > 0)).sum() for lp, e in zip(logps, eps))
    nll /= sum((e.loss_mask[1:] > 0).sum() for e in eps)
    assert abs(losses[0] - nll) < 1e-5
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert losses[-1] < 0.8 * losses[0]


# ---------------------------------------------------------------------------------------------
# (f) asynchronous checkpoints survive the steps that donate the saved buffers


@pytest.mark.parametrize("devices", [1, 4])
def test_async_checkpoint_holds_the_state_it_was_given(model_state, tmp_path, devices):
    """Learner steps donate the state an async save is still writing: the checkpoint must hold
    the state as it was at save(), not the buffers XLA reused."""
    from rl.checkpoint import Checkpointer

    mesh = make_mesh(1, devices // 2 or 1, 2 if devices > 1 else 1, devices=jax.devices()[:devices])
    learner = Learner(_model(model_state, mesh), make_optimizer(1e-2, total_steps=10), mesh=mesh)
    batch = make_batch(_episodes(seed=9), _advantages(8), row_len=32)
    learner.update(batch)
    saved = jax.tree.map(lambda x: np.array(x, copy=True), nnx.to_pure_dict(learner.state))
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=True)
    ckpt.save(1, learner.state, {"version": 1}, {})
    for _ in range(3):  # each step donates the previous state (where nothing else holds it)
        learner.update(batch)
    fresh = Learner(_model(model_state, mesh), make_optimizer(1e-2, total_steps=10), mesh=mesh)
    state, meta, groups = ckpt.restore(fresh.state)
    ckpt.close()
    restored = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    assert meta == {"version": 1} and groups == {}
    assert _max_diff(restored, saved) == 0.0
    now = jax.tree.map(np.asarray, nnx.to_pure_dict(learner.params()))
    assert _max_diff(restored[0], now) > 0  # the learner moved on meanwhile
