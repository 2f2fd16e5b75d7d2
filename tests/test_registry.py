"""Registries are the single source of names: a loss registered by a user's module, with its
properties, is chosen from YAML, validated by the config and trained by the learner."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import create_model, make_mesh, tiny
from rl import config as C
from rl.algorithms import ADVANTAGES, LOSSES, register_advantage, register_loss
from rl.algorithms import losses as L
from rl.engines import ENGINES, engine_spec
from rl.learner import Learner, StepConfig, make_batch
from rl.tasks import TASKS, ArithmeticTask
from rl.types import Episode

TOL = dict(rtol=0, atol=1e-5)
USER_LOSSES = ("test_reinforce", "test_reinforce_prox", "test_seq_reinforce")


def _no_clip(x):
    z = jnp.zeros(x.mask.shape, bool)
    return dict(clipped_low=z, clipped_high=z, dual_clipped=z, is_masked=z)


def reinforce(x: L.LossInputs, cfg: L.LossConfig) -> L.TokenTerms:
    """Plain REINFORCE: -A logp per token (on-policy gradient, no ratio, no clip)."""
    one = jnp.ones_like(x.mask)
    return L.TokenTerms(
        -x.advantages * x.logp, one, x.logp - x.behavior_logp, is_weight=one, **_no_clip(x)
    )


def reinforce_prox(x: L.LossInputs, cfg: L.LossConfig) -> L.TokenTerms:
    """REINFORCE through the proximal ratio: -A pi/pi_prox, value -A at the update's start and
    the same gradient as `reinforce` (-A grad logp)."""
    ratio = jnp.exp(x.logp - x.proximal_logp)
    one = jnp.ones_like(x.mask)
    return L.TokenTerms(
        -x.advantages * ratio, ratio, x.logp - x.proximal_logp, is_weight=one, **_no_clip(x)
    )


@pytest.fixture
def user_losses():
    """What a user's module does at import: register losses with their properties."""
    register_loss("test_reinforce")(reinforce)  # decorator style
    register_loss("test_reinforce_prox", reinforce_prox, needs_proximal=True)  # call style
    register_loss("test_seq_reinforce", reinforce, sequence_level=True, accepts_is_correction=False)
    try:
        yield
    finally:
        for name in USER_LOSSES:
            LOSSES.pop(name, None)


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


# ---------------------------------------------------------------------------------------------
# registry API


def test_builtin_specs_carry_the_properties():
    assert L.loss_spec("ppo_clip") == L.LossSpec("ppo_clip", L.ppo_clip)
    dec = L.loss_spec("decoupled_ppo")
    assert dec.needs_proximal and not dec.accepts_is_correction and not dec.sequence_level
    assert L.loss_spec("gspo").sequence_level and not L.loss_spec("gspo").needs_proximal
    assert L.loss_spec("sft").supervised
    assert L.policy_losses()[:3] == ("ppo_clip", "decoupled_ppo", "gspo")
    assert "sft" in LOSSES and "sft" not in L.policy_losses()
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; valid names: \[.*'ppo_clip'"):
        L.loss_spec("nope")
    assert ADVANTAGES["grpo"].min_group_size == 2
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ADVANTAGES)


def test_needs_proximal():
    assert not L.needs_proximal("ppo_clip", "none")
    assert not L.needs_proximal("gspo", "none")
    assert L.needs_proximal("decoupled_ppo", "none")
    for corr in ("tis_token", "tis_seq", "mis_token", "mis_seq"):
        assert L.needs_proximal("ppo_clip", corr) and L.needs_proximal("gspo", corr)
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        L.needs_proximal("ppo", "none")
    with pytest.raises(ValueError, match="unknown is_correction 'tis'"):
        L.needs_proximal("ppo_clip", "tis")


def test_token_level():
    assert L.token_level("ppo_clip", L.LossConfig())
    assert L.token_level("decoupled_ppo", L.LossConfig(is_correction="none"))
    assert L.token_level("sft", L.LossConfig())
    assert not L.token_level("gspo", L.LossConfig())
    assert not L.token_level("ppo_clip", L.LossConfig(is_correction="tis_seq"))
    assert not L.token_level("ppo_clip", L.LossConfig(aggregation="seq_mean_token_mean"))


def test_user_loss_specs(user_losses):
    assert L.loss_spec("test_reinforce") == L.LossSpec("test_reinforce", reinforce)
    assert L.needs_proximal("test_reinforce_prox", "none")
    assert not L.needs_proximal("test_reinforce", "none")
    assert not L.token_level("test_seq_reinforce", L.LossConfig())
    assert set(USER_LOSSES) <= set(L.policy_losses())
    with pytest.raises(ValueError, match="already registered"):
        register_loss("test_reinforce", reinforce)
    # the spec's property, not the name, gates the is_correction
    x = dict(
        logp=np.zeros((1, 2)), behavior_logp=np.zeros((1, 2)), advantages=np.ones(1),
        mask=np.ones((1, 2)), proximal_logp=np.zeros((1, 2)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="'test_seq_reinforce' takes no is_correction"):
        L.compute_loss("test_seq_reinforce", x, L.LossConfig(is_correction="tis_token"))
    with pytest.raises(ValueError, match="'test_reinforce_prox' needs proximal_logp"):
        L.compute_loss("test_reinforce_prox", dict(x, proximal_logp=None), L.LossConfig())


def test_sft_loss_is_the_token_mean_nll():
    lp = np.array([[-1.0, -2.0, -3.0], [-0.5, -4.0, 7.0]])
    m = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    loss, met = L.compute_loss("sft", dict(logp=lp, behavior_logp=None, advantages=None, mask=m),
                               L.LossConfig())  # fmt: skip
    np.testing.assert_allclose(float(loss), (1 + 2 + 0.5 + 4 - 7) / 5, **TOL)
    assert float(met["approx_kl"]) == 0.0 and float(met["clip_fraction"]) == 0.0


# ---------------------------------------------------------------------------------------------
# the config validates names against the live registries


def test_user_loss_selected_from_yaml(user_losses, tmp_path):
    path = _write(
        tmp_path,
        "algorithm:\n  loss: test_reinforce\n  advantage: rloo\nlearner:\n  pack: true\n",
    )
    cfg = C.load(path)
    assert cfg.algorithm.loss == "test_reinforce" and cfg.learner.pack
    assert C.load(None, ["algorithm.loss=test_reinforce_prox"]).algorithm.loss == (
        "test_reinforce_prox"
    )
    # the reference describes the live registry
    rows = {r[0]: r[1] for r in C.reference_rows()}
    assert rows["algorithm.loss"] == (
        "one of 'ppo_clip', 'decoupled_ppo', 'gspo', 'test_reinforce', 'test_reinforce_prox', "
        "'test_seq_reinforce'"
    )


def test_user_loss_properties_drive_config_checks(user_losses, tmp_path):
    path = _write(tmp_path, "algorithm:\n  loss: test_seq_reinforce\nlearner:\n  pack: true\n")
    with pytest.raises(C.ConfigError) as info:
        C.load(path)
    msg = str(info.value)
    for piece in ("learner.pack", "'test_seq_reinforce'", "sequence-level", "token-level"):
        assert piece in msg, (piece, msg)
    assert "test_reinforce / test_reinforce_prox" in msg and "gspo" not in msg.split("valid:")[1]
    with pytest.raises(C.ConfigError, match=r"algorithm.is_correction: invalid value 'tis_token'"):
        C.load(None, ["algorithm.loss=test_seq_reinforce", "algorithm.is_correction=tis_token"])
    with pytest.raises(C.ConfigError, match=r"algorithm.is_correction: .*'decoupled_ppo'"):
        C.load(None, ["algorithm.loss=decoupled_ppo", "algorithm.is_correction=mis_token"])
    assert C.load(None, ["algorithm.loss=test_reinforce", "algorithm.is_correction=tis_seq"])


def test_unregistered_loss_is_rejected_again(tmp_path):
    path = _write(tmp_path, "algorithm:\n  loss: test_reinforce\n")
    with pytest.raises(C.ConfigError, match="algorithm.loss: invalid value 'test_reinforce'"):
        C.load(path)


@pytest.mark.parametrize(
    "text, key, bad, valid",
    [
        ("algorithm:\n  loss: reinforce\n", "algorithm.loss", "reinforce", L.policy_losses),
        ("algorithm:\n  advantage: gae\n", "algorithm.advantage", "gae", lambda: ADVANTAGES),
        ("task:\n  name: sudoku\n", "task.name", "sudoku", lambda: TASKS),
        # engines are named from their registry too (rl.engines), not a fixed list
        ("rollout:\n  engine: sglang\n", "rollout.engine", "sglang", lambda: ENGINES),
        # a supervised loss is registered but is no algorithm.loss
        ("algorithm:\n  loss: sft\n", "algorithm.loss", "sft", L.policy_losses),
    ],
)
def test_unknown_names_list_the_registry(tmp_path, text, key, bad, valid):
    path = _write(tmp_path, text)
    with pytest.raises(C.ConfigError) as info:
        C.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: {key}: invalid value {bad!r}; valid: "), msg
    assert msg.split("valid: ")[1].startswith(", ".join(repr(n) for n in valid())), msg


def test_did_you_mean_for_registry_names(tmp_path):
    with pytest.raises(C.ConfigError, match=r"did you mean 'decoupled_ppo'\?"):
        C.load(None, ["algorithm.loss=decoupled_pp"])
    with pytest.raises(C.ConfigError, match=r"did you mean 'countdown'\?"):
        C.load(None, ["task.name=countdwn"])
    with pytest.raises(C.ConfigError, match="algorithm.advantage: expected str, got 3"):
        C.load(None, ["algorithm.advantage=3"])


def test_user_advantage_and_task(monkeypatch):
    with pytest.raises(C.ConfigError, match="advantage 'grpo' needs groups of at least 2"):
        C.load(None, ["rollout.group_size=1"])
    monkeypatch.setitem(TASKS, "test_arith", ArithmeticTask)
    try:
        register_advantage("test_batch_baseline", lambda r, v, *, eps: r - r.mean(),
                           min_group_size=1)  # fmt: skip
        cfg = C.load(
            None,
            ["rollout.group_size=1", "algorithm.advantage=test_batch_baseline",
             "task.name=test_arith"],
        )  # fmt: skip
        assert cfg.algorithm.advantage == "test_batch_baseline" and cfg.task.name == "test_arith"
    finally:
        ADVANTAGES.pop("test_batch_baseline", None)


USER_MODULE = """
import dataclasses
from typing import ClassVar

from rl.engines import jax_local, jax_worker, jax_worker_options, register_engine
from rl.tasks import ArithmeticTask, register_task


@register_task
@dataclasses.dataclass(frozen=True)
class EchoTask(ArithmeticTask):
    name: ClassVar[str] = "test_echo"


register_engine(
    "test_engine", local=jax_local, worker=jax_worker, worker_options=jax_worker_options
)
"""


def test_user_task_and_engine_registered_by_an_imported_module(tmp_path, monkeypatch):
    """A module named in `imports` registers a task and an engine: both names are then valid
    in the config, the engine builds through its spec, and an unknown engine name is an error
    naming the key, the value and every registered name."""
    (tmp_path / "my_registrations.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = C.load(
            None,
            ["imports=[my_registrations]", "task.name=test_echo", "rollout.engine=test_engine"],
        )
        assert cfg.task.name == "test_echo" and cfg.rollout.engine == "test_engine"
        assert engine_spec("test_engine").local.__name__ == "jax_local"
        assert not engine_spec("test_engine").hf_weights
        with pytest.raises(C.ConfigError) as info:
            C.load(None, ["imports=[my_registrations]", "rollout.engine=sglang"])
        assert str(info.value).startswith(
            "rollout.engine: invalid value 'sglang'; valid: 'jax', 'vllm', 'test_engine'"
        ), info.value
        assert "rl.engines.register_engine" in str(info.value)
        with pytest.raises(ValueError, match="already registered"):
            from rl.engines import jax_local, jax_worker, jax_worker_options, register_engine

            register_engine(
                "jax", local=jax_local, worker=jax_worker, worker_options=jax_worker_options
            )
    finally:
        TASKS.pop("test_echo", None)
        ENGINES.pop("test_engine", None)
        monkeypatch.delitem(sys.modules, "my_registrations", raising=False)
    with pytest.raises(C.ConfigError, match="task.name: invalid value 'test_echo'"):
        C.load(None, ["task.name=test_echo"])
    with pytest.raises(ValueError, match="unknown rollout engine 'test_engine'; valid: jax, vllm"):
        engine_spec("test_engine")


# ---------------------------------------------------------------------------------------------
# the learner trains a user loss chosen from YAML

CONFIG = tiny(num_hidden_layers=1, hidden_size=64, intermediate_size=128, head_dim=16)
LENGTHS = (30, 12, 21, 9, 25, 17)


def _episodes(seed=0):
    rng = np.random.RandomState(seed)
    eps = []
    for i, n in enumerate(LENGTHS):
        p = 3 + i % 4
        mask = np.zeros(n, np.int8)
        mask[p:] = 1
        mask[p + 2 : p + 4] = 0  # an observation in the middle
        tokens = rng.randint(0, CONFIG.vocab_size, n)
        behavior = np.where(mask > 0, -3.0 + 0.1 * rng.standard_normal(n), 0.0)
        eps.append(Episode(f"e{i}", tokens, mask, behavior.astype(np.float32),
                           np.where(mask > 0, 0, -1), p, reward=float(i % 3)))  # fmt: skip
    return eps


def _numpy_logp(model, eps, row_len=32):
    """log p(token_t | tokens_<t) per episode: logits of a full forward, float64 log-softmax."""
    tokens = np.zeros((len(eps), row_len), np.int32)
    for b, e in enumerate(eps):
        tokens[b, : len(e.tokens)] = e.tokens
    logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)), np.float64)
    out = []
    for b, e in enumerate(eps):
        x = logits[b, : len(e.tokens) - 1]
        lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
        out.append(x[np.arange(len(x)), e.tokens[1:]] - lse)
    return out


def _learner(cfg: C.RunConfig, lr: float, loss: str | None = None) -> Learner:
    """A one-device learner whose step is built from the config, as the trainer builds it."""
    a = cfg.algorithm
    loss = loss or a.loss
    step = StepConfig(
        loss=loss,
        loss_cfg=L.LossConfig(clip_eps=a.clip_eps, aggregation=a.aggregation),
        needs_proximal=L.needs_proximal(loss, a.is_correction),
    )
    mesh = make_mesh(devices=jax.devices()[:1])
    return Learner(create_model(CONFIG, seed=0), optax.sgd(lr), mesh=mesh, step_cfg=step)


def _params(learner):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(learner.params()))


@pytest.mark.slow
def test_learner_update_with_yaml_loss_matches_numpy(user_losses, tmp_path):
    cfg = C.load(_write(tmp_path, "algorithm:\n  loss: test_reinforce\n"))
    eps = _episodes()
    adv = np.random.RandomState(1).standard_normal(len(eps)).astype(np.float32)
    batch = make_batch(eps, adv, row_len=32)

    learner = _learner(cfg, lr=1.0)
    logps = _numpy_logp(learner.model, eps)
    # the reference: token mean of -A logp over trained tokens, in float64
    num = sum(-(a * lp * (e.loss_mask[1:] > 0)).sum() for lp, e, a in zip(logps, eps, adv))
    den = sum((e.loss_mask[1:] > 0).sum() for e in eps)
    before = _params(learner)
    met = learner.update(batch)
    np.testing.assert_allclose(met["loss"], num / den, **TOL)
    np.testing.assert_allclose(met["pg_loss"], num / den, **TOL)
    np.testing.assert_allclose(met["num_tokens"], den, **TOL)
    delta = jax.tree.map(lambda a, b: b - a, before, _params(learner))
    assert max(float(np.abs(d).max()) for d in jax.tree.leaves(delta)) > 1e-4

    # needs_proximal=True makes the learner supply proximal_logp: -A pi / pi_prox is -A at the
    # update's start and has the same gradient, so sgd takes the same step.
    prox = _learner(cfg, lr=1.0, loss="test_reinforce_prox")
    assert prox.step_cfg.needs_proximal
    met_p = prox.update(batch)
    ref_p = sum(-(a * (e.loss_mask[1:] > 0)).sum() for e, a in zip(eps, adv)) / den
    np.testing.assert_allclose(met_p["loss"], ref_p, **TOL)
    np.testing.assert_allclose(met_p["ratio_mean"], 1.0, **TOL)
    delta_p = jax.tree.map(lambda a, b: b - a, before, _params(prox))
    diff = jax.tree.map(lambda x, y: float(np.abs(x - y).max()), delta, delta_p)
    assert max(jax.tree.leaves(diff)) < 1e-5


def test_learner_packing_follows_the_spec(user_losses, tmp_path):
    cfg = C.load(None, ["algorithm.loss=test_seq_reinforce"])
    eps = _episodes(seed=3)
    packed = make_batch(eps, np.ones(len(eps)), row_len=64, pack=True)
    assert packed.segment_ids.max() >= 2
    with pytest.raises(ValueError, match=r"'test_seq_reinforce' \(a sequence-level loss\)"):
        _learner(cfg, lr=0.0).update(packed)
