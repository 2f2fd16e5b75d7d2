"""The GPU tier (`JAX_PLATFORMS=cuda python -m pytest -m gpu`): cuDNN against XLA attention,
HF parity in float32, learner against sampler log-probs, the device-split async trainer and a
short run that learns, on a real GPU. Skipped (and listed) on machines without one."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from run_files import metric_rows

from models import create_model, init_cache, load_hf, make_mesh, save_hf, tiny
from models.attention import segment_lengths
from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl import config as C
from rl.agent import run_episodes
from rl.learner import Learner, StepConfig, make_batch
from rl.rollout.base import GenerationRequest, SamplingParams
from rl.rollout.jax_engine import JaxEngine
from rl.tasks import ArithmeticTask
from rl.trainer import Trainer

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64)
SHAPE.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
DEFAULT = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")


def _model(**fields):
    return create_model(tiny(**SHAPE, **fields), make_mesh(devices=jax.devices()[:1]), seed=3)


def _same_params(dst, src):
    """dst with src's parameter values (cast to dst's dtype)."""
    new = jax.tree.map(
        lambda a, b: b.astype(a.dtype), nnx.state(dst, nnx.Param), nnx.state(src, nnx.Param)
    )
    nnx.update(dst, new)
    return dst


_logits = nnx.jit(lambda m, t, p, s: m(t, p, s))
_native = nnx.jit(lambda m, t, p, s, n: m(t, p, s, n))


def test_cudnn_attention_matches_xla_plain_and_packed():
    """bf16 cuDNN and XLA attention against a float32 reference, plain rows and packed rows."""
    ref = _model(dtype="float32")
    xla = _same_params(_model(dtype="bfloat16", attention_impl="xla"), ref)
    cudnn = _same_params(_model(dtype="bfloat16", attention_impl="cudnn"), ref)
    rng = np.random.RandomState(0)
    B, T = 4, 128
    tokens = rng.randint(0, SHAPE["vocab_size"], (B, T)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    seg = np.ones((B, T), np.int32)
    want = np.asarray(_logits(ref, tokens, pos, seg))
    scale = float(np.abs(want).max())
    for model in (xla, cudnn):
        got = np.asarray(_logits(model, tokens, pos, seg), np.float32)
        assert np.abs(got - want).max() <= 0.05 * scale, np.abs(got - want).max()
    # Packed: each row holds two sequences (segments 1 and 2, positions restarting at 0);
    # their logits equal those of the sequences in rows of their own.
    cut = 64
    packed_pos = np.concatenate([np.arange(cut), np.arange(T - cut)]).astype(np.int32)
    packed_pos = np.broadcast_to(packed_pos, (B, T))
    packed_seg = np.broadcast_to(np.r_[np.ones(cut), 2 * np.ones(T - cut)].astype(np.int32), (B, T))
    first = np.asarray(_logits(ref, tokens[:, :cut], pos[:, :cut], seg[:, :cut]))
    second_tokens = np.ascontiguousarray(tokens[:, cut:])
    second = np.asarray(_logits(ref, second_tokens, pos[:, : T - cut], seg[:, : T - cut]))
    for model in (ref, xla, cudnn):
        got = np.asarray(_logits(model, tokens, packed_pos, packed_seg), np.float32)
        tol = 1e-4 * scale if model is ref else 0.05 * scale
        assert np.abs(got[:, :cut] - first).max() <= tol
        assert np.abs(got[:, cut:] - second).max() <= tol
    # cuDNN with the segments passed natively (no mask), rows of 1 to 5 segments plus padding.
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(8, T - 8), b + 1, replace=False))
        for i, (lo, hi) in enumerate(zip(np.r_[0, cuts[:-1]], cuts)):
            seg[b, lo:hi], pos[b, lo:hi] = i + 1, np.arange(hi - lo)
    lengths = segment_lengths(seg)
    valid = seg > 0
    want = np.asarray(_logits(ref, tokens, pos, seg))[valid]
    got = np.asarray(_native(cudnn, tokens, pos, seg, lengths), np.float32)[valid]
    assert np.abs(got - want).max() <= 0.05 * scale, np.abs(got - want).max()


def test_hf_load_and_export_parity_in_float32(tmp_path):
    """float32 on a GPU means float32: logits equal transformers' within the CPU's 1e-4."""
    cfg = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path / "hf"))
    tokens = np.random.RandomState(1).randint(0, 256, (2, 32))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    model = load_hf(str(tmp_path / "hf"))
    assert model.config.precision == "highest"
    got = np.asarray(model(tokens))
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    save_hf(model, str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
    with torch.no_grad():
        again = back(torch.tensor(tokens)).logits.numpy()
    assert np.abs(again - want).max() < 1e-5


def test_learner_and_sampler_logprobs_agree(tmp_path):
    """Behavior log-probs from the sampler equal the learner's within 1e-5 in float32."""
    build_task_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.vocab_size <= SHAPE["vocab_size"]
    model = _model(dtype="float32")
    engine = JaxEngine(model, chunk=8)
    task = ArithmeticTask()
    eps = run_episodes(
        engine,
        task,
        tok,
        task.problems("train", 16),
        SamplingParams(16, 1.0),
        seeds=list(range(16)),
    )
    learner = Learner(model, optax.sgd(0.0), step_cfg=StepConfig(temperature=1.0))
    batch = make_batch(eps, np.zeros(len(eps)), row_len=64)
    lp = learner.logprobs(batch)
    m = batch.loss_mask > 0
    assert m.sum() > 0 and np.abs(lp[m] - batch.behavior_logp[m]).max() < 1e-5


def _decode_case(seed: int, B: int = 8, S: int = 128, steps: int = 70):
    """(B, S, lengths, prompts, feed) of a decode comparison: 70 steps cross the kernel's
    64-slot blocks."""
    rng = np.random.RandomState(seed)
    lengths = jnp.asarray(rng.randint(1, 20, B), jnp.int32)
    prompts = jnp.asarray(rng.randint(0, SHAPE["vocab_size"], (B, 20)), jnp.int32)
    feed = rng.randint(0, SHAPE["vocab_size"], (steps, B)).astype(np.int32)
    return B, S, lengths, prompts, feed


def _decode_steps(model, case, k_pos, prefill, decode, pre_args, step_args):
    """Logits [steps, B, V] of prefill(model, prompts, lengths, cache, *pre_args), then one
    decode(model, token, position, cache, *step_args) per fed token."""
    B, S, lengths, prompts, feed = case
    cache = init_cache(model.config, B, S, k_pos=k_pos)
    _, cache = prefill(model, prompts, lengths, cache, *pre_args)
    out = []
    for i, tok in enumerate(feed):
        logits, cache = decode(model, jnp.asarray(tok), lengths + i, cache, *step_args)
        out.append(np.asarray(logits))
    return np.stack(out)


def test_pallas_decode_attention_matches_xla():
    """Prefill then decode steps with the compiled Pallas decode kernel against the XLA path:
    float32 logits within 1e-5 (no TF32 in the kernel); bfloat16 as close to the float32
    reference as XLA's bfloat16 decode; both key layouts (the engine's is k_pos 2); one GPU's
    engine picks the kernel by default."""
    decode = nnx.jit(lambda m, t, p, c, a: m.decode(t, p, c, attention=a), static_argnames=("a",))
    prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
    case = _decode_case(seed=0)

    def run(model, attention, k_pos=3):
        return _decode_steps(model, case, k_pos, prefill, decode, (), (attention,))

    ref = _model(dtype="float32")
    want = run(ref, "xla")
    for k_pos in (3, 2):
        assert np.abs(run(ref, "pallas", k_pos) - want).max() < 1e-5, k_pos
    bf16 = _same_params(_model(dtype="bfloat16"), ref)
    err_xla = np.abs(run(bf16, "xla") - want).max()
    for k_pos in (3, 2):
        err_pallas = np.abs(run(bf16, "pallas", k_pos) - want).max()
        assert err_pallas < max(2 * err_xla, 1e-2), (k_pos, err_pallas, err_xla)
    engine = JaxEngine(bf16)
    assert engine.decode_attention == "pallas" and engine.k_pos == 2


def test_folded_norms_decode_matches_xla():
    """The engine's decode on one GPU: the norms' weights folded into the q/k/v and gate/up
    kernels, the compiled attention and activation kernels finishing the norms, against XLA's
    unfolded decode: float32 logits within 1e-5; bfloat16 as close to the float32 reference as
    XLA's bfloat16 decode. The norm weights drawn around 1, so the fold is not a no-op."""
    case = _decode_case(seed=1)
    layers = lambda m, fold: m.per_layer(fold=fold)
    prefill = nnx.jit(
        lambda m, t, n, c, fold: m.prefill(t, n, c, layers=layers(m, fold), folded=fold),
        static_argnames=("fold",),
    )
    decode = nnx.jit(
        lambda m, t, p, c, fold: m.decode(
            t, p, c, layers(m, fold), "pallas" if fold else "xla", folded=fold
        ),
        static_argnames=("fold",),
    )

    steps_of = lambda model, fold: _decode_steps(model, case, 2, prefill, decode, (fold,), (fold,))

    ref = _model(dtype="float32")
    leaves, treedef = jax.tree.flatten_with_path(nnx.state(ref, nnx.Param))
    norm = lambda path, x: "norm" in jax.tree_util.keystr(path)
    noise = lambda x: 1 + 0.2 * jax.random.normal(jax.random.key(4), x.shape, x.dtype)
    nnx.update(ref, jax.tree.unflatten(treedef, [noise(x) if norm(p, x) else x for p, x in leaves]))
    want = steps_of(ref, False)
    assert np.abs(steps_of(ref, True) - want).max() < 1e-5
    bf16 = _same_params(_model(dtype="bfloat16"), ref)
    err_xla = np.abs(steps_of(bf16, False) - want).max()
    err_folded = np.abs(steps_of(bf16, True) - want).max()
    assert err_folded < max(2 * err_xla, 1e-2), (err_folded, err_xla)
    assert JaxEngine(bf16).fold_norms


def test_auto_decodes_with_xla_when_the_kernels_fail_on_this_gpu_fake_lowering_fault(
    monkeypatch, capsys
):
    """A jax that cannot lower the Pallas kernels on this GPU (simulated: the kernel raises as
    jax's lowering does): 'auto' says why on stderr and generates with XLA's paths."""
    from test_sample_kernel import refuse_lowering

    from models import decode_attention as da
    from rl.rollout import kernels

    kernels.failure.cache_clear()
    try:
        monkeypatch.setattr(da, "decode_attention_qkv", refuse_lowering)
        engine = JaxEngine(_model(dtype="bfloat16"))
        assert engine.decode_attention == "xla" and not engine.sample_kernel
        err = capsys.readouterr().err
        assert "the Pallas kernels fail on" in err and "NotImplementedError" in err, err
        req = GenerationRequest("r", np.arange(1, 6, dtype=np.int32), SamplingParams(8, seed=0))
        (out,) = engine.generate([req])
        assert len(out.token_ids) == 8
    finally:
        kernels.failure.cache_clear()


def test_pallas_sampling_matches_xla():
    """The compiled sampling kernels at a 151,936-entry vocabulary against the XLA sampler:
    the same tokens from the same keys, log-probs within 1e-5, the argmax for greedy rows."""
    from rl.rollout import sample_kernel
    from rl.rollout.sampling import process_logits, sample

    B, V = 128, 151936
    x = 4.0 * jax.random.normal(jax.random.key(0), (B, V), jnp.float32)
    temp = jnp.tile(jnp.asarray([1.0, 0.6, 0.0, 1.5], jnp.float32), B // 4)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), B))
    ones, none = jnp.ones(B), jnp.zeros(B, jnp.int32)
    want = jax.jit(lambda x, k, t: sample(process_logits(x, t, none, ones, False), k, t))(
        x, keys, temp
    )
    got = jax.jit(sample_kernel.sample)(x, keys, temp)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.abs(np.asarray(got[1]) - np.asarray(want[1])).max() < 1e-5
    greedy = np.asarray(temp) == 0
    np.testing.assert_array_equal(np.asarray(got[0])[greedy], np.argmax(x, axis=1)[greedy])


def test_warm_engine_serves_without_compiling():
    """One GPU's engine (ragged attention) after warm(prompt_len, max_new_tokens): requests
    within those lengths, admitted as slots free, trace no program, and the cache stays at the
    longest length (no relayouts)."""
    eng = JaxEngine(_model(dtype="bfloat16"), chunk=8, max_batch=16)
    assert eng.ragged
    assert eng.warm(prompt_len=24, max_new_tokens=100) > 0
    warmed = eng.traces
    rng = np.random.RandomState(0)
    reqs = [
        GenerationRequest(
            f"r{i}",
            rng.randint(2, SHAPE["vocab_size"], rng.randint(1, 25)).astype(np.int32),
            SamplingParams(max_new_tokens=int(rng.randint(1, 101)), seed=i),
        )
        for i in range(40)
    ]
    out = eng.generate(reqs)
    assert [len(g.token_ids) for g in out] == [r.params.max_new_tokens for r in reqs]
    assert eng.traces == warmed
    assert eng._S() == 128  # length_bucket(24 + 100 - 1)
    eng.close()


RUN = [
    "logging.progress=false",
    "logging.tensorboard=false",
    "trainer.eval_every=20",
]


def test_device_split_async_trainer(tmp_path):
    """With two or more GPUs the default placement splits them: the sampler on device 0, the
    learner on the rest; the async run stays within its staleness bound."""
    if len(jax.devices()) < 2:
        pytest.skip(f"needs 2 GPUs, this host has {len(jax.devices())}")
    over = [*RUN, f"run_root={tmp_path}", "name=split", "sft.steps=50", "trainer.total_updates=6"]
    trainer = Trainer(C.load(DEFAULT, over))
    assert trainer.place.kind == "split" and trainer.place.split.rollout == (jax.devices()[0],)
    trainer.run()
    rows = metric_rows(trainer.run_dir)
    assert [r["step"] for r in rows] == list(range(7))
    assert all(r["staleness/max"] <= 2 for r in rows[1:])


def test_main_job_learns(tmp_path):
    """The main job, whole, on a GPU: RL takes held-out accuracy from the warm start's (which
    answers like its sloppy demonstrator) past 85% and at least 50 points up, as on the CPU."""
    over = [*RUN, f"run_root={tmp_path}", "name=learn"]
    summary = Trainer(C.load(DEFAULT, over)).run()
    start, end = summary["eval/accuracy_start"], summary["eval/accuracy_end"]
    print(f"held-out accuracy {start:.3f} -> {end:.3f}")
    assert end >= 0.85 and end >= start + 0.5, (start, end)
