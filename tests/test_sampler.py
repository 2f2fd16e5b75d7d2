"""The JAX sampler: behavior log-probs, compilation buckets, greedy/top-k/top-p, seeds, stops,
abort and interrupting weight updates (partial rollouts through the agent)."""

import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from model_weights import randomize

from models import create_model, make_mesh, tiny
from models.kv_cache import init_cache
from models.sharding import shard_model
from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl.agent import run_episodes
from rl.learner import Learner, StepConfig, make_batch
from rl.rollout.base import GenerationRequest, SamplingParams
from rl.rollout.jax_engine import JaxEngine, Warm
from rl.rollout.sampling import SAMPLE_BLOCK, process_logits
from rl.rollout.sampling import key_data as _key_data
from rl.rollout.sampling import sample as _sample
from rl.startup import CompileCounter
from rl.tasks import ArithmeticTask
from rl.types import Episode

CONFIG = tiny()
V = CONFIG.vocab_size


@pytest.fixture(scope="module")
def model():
    return randomize(create_model(CONFIG, seed=0), seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return JaxEngine(model, chunk=4)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_task_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _req(rid, prompt, **params):
    return GenerationRequest(rid, np.asarray(prompt, np.int32), SamplingParams(**params))


def _prompt(seed, n):
    return np.random.RandomState(seed).randint(2, V, n).astype(np.int32)


_LEARNERS = {}


def _learner_logp(model, episodes, temperature, chunk=0):
    """The learner's log p(token) of every generated token, and the engine's, flattened."""
    key = (id(model), temperature, chunk)
    if key not in _LEARNERS:  # one compiled log-prob program per (weights, temperature, chunk)
        _LEARNERS[key] = Learner(
            model,
            optax.sgd(0.0),
            mesh=make_mesh(devices=jax.devices()[:1]),
            step_cfg=StepConfig(temperature=temperature, logprob_chunk=chunk),
        )
    learner = _LEARNERS[key]
    batch = make_batch(episodes, np.zeros(len(episodes)), row_len=32)
    lp = learner.logprobs(batch)
    m = batch.loss_mask > 0
    return lp[m], batch.behavior_logp[m], batch.versions[m]


# ---------------------------------------------------------------------------------------------
# (a) behavior log-probs == learner log-probs


@pytest.mark.parametrize("temperature,chunk", [(1.0, 0), (0.7, 48)])
def test_behavior_logprobs_equal_learner_logprobs(model, engine, tok, temperature, chunk):
    task = ArithmeticTask()
    problems = task.problems("train", 4)
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    eps = run_episodes(engine, task, tok, problems, params, seeds=list(range(4)))
    assert sum(e.num_generated for e in eps) >= 20
    learner_lp, behavior_lp, _ = _learner_logp(model, eps, temperature, chunk)
    diff = np.abs(learner_lp - behavior_lp).max()
    assert diff < 1e-5, diff
    if temperature != 1.0:  # the check is sensitive to a temperature mismatch
        other, _, _ = _learner_logp(model, eps, 1.0)
        assert np.abs(other - behavior_lp).max() > 1e-2


# ---------------------------------------------------------------------------------------------
# (b) one compilation per shape bucket


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_served_weights_are_the_weights_given(model_type):
    """The engine keeps its weights in a decode layout (per-layer slices, fused q/k/v and
    gate/up kernels, the stacked copy emptied); served_params() gives back exactly what it
    was given, after construction and after update_weights."""
    cfg = tiny(model_type=model_type)
    pure = lambda p: jax.tree.map(np.asarray, nnx.to_pure_dict(p))
    first = randomize(create_model(cfg, seed=1), seed=1)
    eng = JaxEngine(first)
    want = pure(nnx.state(first, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, pure(eng.served_params()), want)
    second = randomize(create_model(cfg, seed=2), seed=2)
    eng.update_weights(1, nnx.state(second, nnx.Param))
    got = pure(eng.served_params())
    jax.tree.map(np.testing.assert_array_equal, got, pure(nnx.state(second, nnx.Param)))
    eng.close()


@pytest.mark.parametrize("dtype, bits", [("float32", 24), ("bfloat16", 8)])
def test_served_weights_with_folded_norms_are_within_one_rounding(dtype, bits):
    """With the decode kernel (interpreted here) the layout folds each norm's weight into the
    q/k/v and gate/up kernels; served_params() divides it out again: those kernels within two
    roundings of the weights given (one each way), every other weight exactly."""
    cfg = tiny(dtype=dtype, param_dtype=dtype)
    model = randomize(create_model(cfg, seed=1), seed=1)
    eng = JaxEngine(model, decode_attention="pallas")
    assert eng.fold_norms
    flat = lambda p: {
        jax.tree_util.keystr(k): np.asarray(v, np.float32)
        for k, v in jax.tree.flatten_with_path(nnx.to_pure_dict(p))[0]
    }
    got, want = flat(eng.served_params()), flat(nnx.state(model, nnx.Param))
    assert got.keys() == want.keys()
    folded = ("q_proj']['kernel", "k_proj']['kernel", "v_proj']['kernel", "gate_proj", "up_proj")
    n_folded = 0
    for k, w in want.items():
        if any(f in k for f in folded):
            n_folded += 1
            # two roundings of unit 2^-bits (the fold and its inverse)
            np.testing.assert_allclose(got[k], w, rtol=2.01 * 2.0**-bits, atol=0, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], w, err_msg=k)
    assert n_folded == 5
    eng.close()


@pytest.mark.slow
def test_weights_served_in_the_compute_dtype():
    """float32 master weights with bfloat16 compute are served (and copied) as bfloat16: the
    same tokens and log-probs, bit for bit, as an engine given bfloat16 weights."""
    cfg = tiny(dtype="bfloat16")
    master = randomize(create_model(cfg, seed=1), seed=1)
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(master, nnx.Param))
    reqs = [_req(f"r{i}", _prompt(i, 4 + i), max_new_tokens=12, seed=i) for i in range(6)]
    outs = []
    for weights in (nnx.state(master, nnx.Param), cast):
        eng = JaxEngine(create_model(cfg, seed=3), chunk=4)
        eng.update_weights(1, weights)
        assert {a.dtype for a in jax.tree.leaves(eng.params)} == {jnp.dtype(jnp.bfloat16)}
        outs.append([(g.token_ids.tolist(), g.logprobs.tolist()) for g in eng.generate(reqs)])
        eng.close()
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_same_bucket_does_not_retrace(model):
    # As in a training run: the engine copies the weights of a model on the learner's mesh.
    eng = JaxEngine(shard_model(model, make_mesh(devices=jax.devices()[:1])), chunk=4)
    # 3 rows (4 slots), prompts of 5..12 tokens (bucket 16), 16 new: the cache grows 16 -> 32.
    eng.generate(
        [_req(f"a{i}", _prompt(i, 5 + 3 * i), max_new_tokens=16, seed=i) for i in range(3)]
    )
    # The serving layout (at construction), one prefill and its insert, a decode per cache
    # length (16, 32) and the relayout that grew the cache.
    assert eng.traces == 6

    # 4 rows (still 4 slots), prompts 3..12, budgets <= 16, other temperatures and stop
    # tokens (<= 4 per request): the same prefill, insert and decodes; the one new program is
    # the relayout that shrinks the cache back to 16 (on a CPU it fits the demand at once).
    def reqs(name, truncate):
        return [
            _req(
                f"{name}{i}",
                _prompt(10 + i, 3 + 3 * i),
                max_new_tokens=10 + i,
                temperature=0.5 + 0.2 * i,
                top_k=i if truncate else 0,
                top_p=1.0 - 0.1 * i if truncate else 1.0,
                stop_token_ids=(1, 2 + i, 7, 9),
                seed=i,
            )
            for i in range(4)
        ]

    eng.generate(reqs("b", truncate=False))
    assert eng.traces == 7
    # Top-k / top-p on: each program once more (its variant that sorts the vocabulary), then
    # other top-k / top-p values reuse it.
    eng.generate(reqs("c", truncate=True))
    assert eng.traces == 10
    eng.generate(reqs("d", truncate=True)[::-1])
    assert eng.traces == 10


@pytest.mark.slow
def test_timeline_records_the_scheduler_calls(model):
    """With a timeline list set, each decode dispatch, read-back, admission (prefill) and weight
    install is recorded with its start and end; every request is admitted once."""
    eng = JaxEngine(model, chunk=4, max_batch=4)
    eng.timeline = []
    eng.generate([_req(f"t{i}", _prompt(i, 3 + i), max_new_tokens=6 + i, seed=i) for i in range(6)])
    eng.update_weights(1, nnx.state(model, nnx.Param))
    kinds = [e[0] for e in eng.timeline]
    assert set(kinds) == {"chunk", "read", "admit", "install"} and kinds.count("install") == 1
    assert all(e[1] <= e[2] for e in eng.timeline)
    assert sum(e[3] for e in eng.timeline if e[0] == "admit") == 6
    chunks = [e for e in eng.timeline if e[0] == "chunk"]
    assert kinds.count("read") == len(chunks)
    assert all(0 < live <= C <= 4 and queued >= 0 for *_, live, queued, S, C in chunks)
    assert any(queued > 0 for *_, queued, S, C in chunks)  # 6 requests, 4 slots
    eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch-invariant", "fixed slots"])
def test_warm_compiles_every_program_serving_uses(model, kind):
    """After warm(prompt_len, max_new_tokens) on fixed slots, requests within those lengths, of
    any prompt bucket, admitted in any number as slots free, trace nothing; where the cache
    resizes (fixed slots, XLA attention) that covers every cache length and the relayouts
    between them. Where slots follow demand warm compiles nothing (0)."""
    opts = dict(cache_len=64) if kind == "batch-invariant" else dict(fixed_slots=True)
    eng = JaxEngine(model, chunk=4, max_batch=8, **opts)
    before = eng.traces
    n = eng.warm(prompt_len=20, max_new_tokens=40)
    assert n == eng.traces - before
    # batch-invariant: 1 decode; prompt buckets 8, 16, 32 x (prefill + insert), one admission
    # size (alone). Fixed slots: cache lengths 16, 32, 64 (a decode each, 6 relayouts), 3
    # prompt buckets x 4 admission sizes (1, 2, 4, 8): 12 prefills, and an insert for each
    # (prompt bucket <= cache length, size): 8 x 4.
    assert n == (7 if kind == "batch-invariant" else 3 + 6 + 12 + 32)
    warmed = eng.traces
    serving = CompileCounter()  # the programs warm compiled concurrently serve: none compiles
    for rnd in range(2):  # an idle engine's second round starts from the cache it left
        reqs = [
            _req(f"w{rnd}-{i}", _prompt(i, 1 + 2 * i), max_new_tokens=5 + 3 * i, seed=i)
            for i in range(10)
        ]
        out = eng.generate(reqs[::-1] if rnd else reqs)
        assert sorted(len(g.token_ids) for g in out) == [5 + 3 * i for i in range(10)]
    assert eng.traces == warmed
    compiled = serving.programs_since_start()
    engine_programs = ("prefill", "insert", "relayout", "decode")
    assert not [p for p in compiled if any(f"_{name}_impl" in p for name in engine_programs)]
    eng.close()
    demand = JaxEngine(model, chunk=4)
    assert demand.warm(prompt_len=20, max_new_tokens=40) == 0
    demand.close()


@pytest.mark.slow
def test_engine_warmed_at_construction_serves_top_k_and_greedy_without_tracing(model):
    """JaxEngine(warm=Warm(.., truncate=True)) compiles before serving, besides warm()'s
    programs, the prefills and the decode chunk that truncate (top-k / top-p): requests with
    top-k, top-p or neither, mixed in one batch, trace nothing."""
    eng = JaxEngine(model, chunk=4, max_batch=8, cache_len=64, warm=Warm(20, 40, truncate=True))
    # warm()'s 7 (one decode, 3 prompt buckets x (prefill + insert)), a truncating decode and 3
    # truncating prefills; and the serving layout, traced when the engine is built.
    assert eng.traces == 1 + 7 + 1 + 3
    warmed = eng.traces
    kinds = [dict(top_k=5), dict(top_p=0.9), dict(temperature=0.0), {}]
    reqs = [
        _req(f"t{i}", _prompt(i, 1 + 2 * i), max_new_tokens=5 + 3 * i, seed=i, **kinds[i % 4])
        for i in range(10)
    ]
    out = eng.generate(reqs)
    assert sorted(len(g.token_ids) for g in out) == [5 + 3 * i for i in range(10)]
    assert eng.traces == warmed
    eng.close()


# ---------------------------------------------------------------------------------------------
# (c) greedy == argmax of full forward passes


def _greedy_reference(model, prompts, steps):
    """Greedy continuation by full forward passes over right-padded rows (no KV cache)."""
    L = 32
    forward = nnx.jit(lambda m, t: m(t))
    rows = [list(p) for p in prompts]
    logps, margins = [[] for _ in rows], []
    for _ in range(steps):
        tokens = np.zeros((len(rows), L), np.int32)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = r
        logits = np.asarray(forward(model, jnp.asarray(tokens)), np.float64)
        for b, r in enumerate(rows):
            x = logits[b, len(r) - 1]
            top2 = np.sort(x)[-2:]
            margins.append(top2[1] - top2[0])
            logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            logps[b].append(logp[int(np.argmax(x))])
            r.append(int(np.argmax(x)))
    return [np.asarray(r[len(p) :]) for r, p in zip(rows, prompts)], logps, min(margins)


def test_greedy_equals_argmax_of_full_forward(model, engine):
    prompts = [_prompt(1, 3), _prompt(2, 9), _prompt(3, 6)]
    steps = 10
    ref, ref_logp, margin = _greedy_reference(model, prompts, steps)
    assert margin > 1e-3  # no near-ties: argmax is well defined
    gens = engine.generate(
        [_req(f"g{i}", p, max_new_tokens=steps, temperature=0.0) for i, p in enumerate(prompts)]
    )
    for g, r, lp in zip(gens, ref, ref_logp):
        np.testing.assert_array_equal(g.token_ids, r)
        assert np.abs(g.logprobs - np.asarray(lp)).max() < 1e-5
        assert g.finish_reason == "length"
        assert (g.versions == 0).all()


# ---------------------------------------------------------------------------------------------
# (d) per-request seeds


@pytest.mark.slow
def test_request_output_independent_of_batch(engine):
    target = _req("t", _prompt(7, 6), max_new_tokens=14, temperature=1.0, seed=1234)
    alone = engine.generate([target])[0]
    others = [
        _req("o1", _prompt(8, 11), max_new_tokens=5, temperature=0.3, seed=5),
        _req("o2", _prompt(9, 2), max_new_tokens=14, temperature=1.0, top_k=3, seed=6),
        _req("o3", _prompt(10, 15), max_new_tokens=9, temperature=0.0),
    ]
    for batch in ([others[0], target, others[1]], [*others, target]):
        out = engine.generate(batch)
        for g in out:
            if g.request_id == "t":
                np.testing.assert_array_equal(g.token_ids, alone.token_ids)
                assert np.abs(g.logprobs - alone.logprobs).max() < 1e-5
    reseeded = SamplingParams(max_new_tokens=14, temperature=1.0, seed=4321)
    other_seed = engine.generate([GenerationRequest("t", target.prompt_ids, reseeded)])[0]
    assert not np.array_equal(other_seed.token_ids, alone.token_ids)
    # Seeds beyond 32 bits stay distinct (jax.random.PRNGKey keeps 32 bits without x64).
    big = [_req(f"s{k}", target.prompt_ids, max_new_tokens=14, seed=2**40 + k) for k in (0, 2**32)]
    g0, g1 = engine.generate(big)
    assert not np.array_equal(g0.token_ids, g1.token_ids)


def test_seed_keys_are_jax_prng_keys():
    for s in (0, 1, 1234, 2**31 - 1, 2**32 - 1):
        np.testing.assert_array_equal(
            _key_data(s), np.asarray(jax.random.key_data(jax.random.PRNGKey(s)))
        )
    assert not np.array_equal(_key_data(2**40), _key_data(2**41))


# ---------------------------------------------------------------------------------------------
# (e) stop tokens and max_new_tokens


def test_stop_tokens_and_budget(engine):
    prompt = _prompt(11, 5)
    full = engine.generate([_req("f", prompt, max_new_tokens=12, temperature=0.0)])[0].token_ids
    # first position k >= 2 whose token did not occur before (a stop there ends exactly there)
    k = next(i for i in range(2, 12) if full[i] not in full[:i])
    reqs = [
        _req("stop", prompt, max_new_tokens=12, temperature=0.0, stop_token_ids=(int(full[k]),)),
        _req("first", prompt, max_new_tokens=12, temperature=0.0, stop_token_ids=(int(full[0]),)),
        _req("len5", prompt, max_new_tokens=5, temperature=0.0),
        # same batch, no stop tokens: another request's stop token must not end this one
        _req("nostop", prompt, max_new_tokens=12, temperature=0.0),
    ]
    g = {x.request_id: x for x in engine.generate(reqs)}
    g["len1"] = engine.generate([_req("len1", prompt, max_new_tokens=1, temperature=0.0)])[0]
    np.testing.assert_array_equal(g["stop"].token_ids, full[: k + 1])
    assert g["stop"].finish_reason == "stop"
    np.testing.assert_array_equal(g["first"].token_ids, full[:1])
    assert g["first"].finish_reason == "stop"
    np.testing.assert_array_equal(g["len5"].token_ids, full[:5])
    assert g["len5"].finish_reason == "length"
    np.testing.assert_array_equal(g["len1"].token_ids, full[:1])
    assert g["len1"].finish_reason == "length"
    np.testing.assert_array_equal(g["nostop"].token_ids, full)
    assert g["nostop"].finish_reason == "length"
    for x in g.values():
        assert len(x.logprobs) == len(x.versions) == len(x.token_ids)


# ---------------------------------------------------------------------------------------------
# (f) top-k / top-p


def test_top_k_1_equals_greedy(engine):
    prompts = [_prompt(20, 4), _prompt(21, 8), _prompt(22, 16)]
    greedy = engine.generate(
        [_req(f"g{i}", p, max_new_tokens=10, temperature=0.0) for i, p in enumerate(prompts)]
    )
    topk = engine.generate(
        [
            _req(f"k{i}", p, max_new_tokens=10, temperature=1.3, top_k=1, seed=99 + i)
            for i, p in enumerate(prompts)
        ]
    )
    for g, k in zip(greedy, topk):
        np.testing.assert_array_equal(k.token_ids, g.token_ids)
        assert np.abs(k.logprobs).max() < 1e-6  # one token left: probability 1


def _numpy_keep(x, temperature, top_k, top_p):
    """The set of tokens kept by temperature -> top-k -> top-p (vLLM's order), in float64."""
    z = x.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    k = len(z) if top_k == 0 else top_k
    keep[order[:k]] = True
    if top_p < 1.0:
        zk = np.where(keep, z, -np.inf)
        p = np.exp(zk - zk.max())
        p /= p.sum()
        mass_before = np.cumsum(p[order]) - p[order]
        keep_p = np.zeros(len(z), bool)
        keep_p[order[mass_before < top_p]] = True
        keep &= keep_p
    return keep, z


def test_process_logits_matches_numpy_top_k_top_p():
    rng = np.random.RandomState(0)
    settings = [  # (temperature, top_k, top_p)
        (1.0, 0, 1.0),
        (0.7, 0, 0.9),
        (1.5, 0, 0.5),
        (1.0, 10, 1.0),
        (0.8, 20, 0.8),
        (1.0, 5, 0.3),
        (2.0, 0, 0.999),
        (0.5, 1, 1.0),
        (0.0, 0, 1.0),  # greedy rows are processed at temperature 1
    ]
    x = (2.0 * rng.standard_normal((len(settings), V))).astype(np.float32)
    temp, topk, topp = (np.asarray(c) for c in zip(*settings))
    out = np.asarray(
        process_logits(
            jnp.asarray(x),
            jnp.asarray(temp, jnp.float32),
            jnp.asarray(topk, jnp.int32),
            jnp.asarray(topp, jnp.float32),
        )
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    for b, (t, k, p) in enumerate(settings):
        keep, z = _numpy_keep(x[b], t if t > 0 else 1.0, k, p)
        np.testing.assert_array_equal(np.isfinite(out[b]), keep)
        assert np.abs(out[b][keep] - z[keep]).max() < 1e-5
        probs = np.exp(z - z.max()) * keep
        probs /= probs.sum()
        if p < 1.0:  # the smallest prefix with mass >= p: dropping its least token falls short
            top_k_set, _ = _numpy_keep(x[b], t, k, 1.0)
            pk = np.exp(z - z.max()) * top_k_set
            pk /= pk.sum()
            mass = pk[keep].sum()
            assert mass >= p and mass - pk[keep].min() < p
        # samples only ever come from the kept set, with the processed distribution's log-prob
        rows = jnp.broadcast_to(jnp.asarray(out[b]), (len(keys), V))
        tok, lp = jax.jit(_sample)(
            rows, jax.random.key_data(keys), jnp.full(len(keys), max(t, 1e-3), jnp.float32)
        )
        tok = np.asarray(tok)
        assert keep[tok].all()
        assert np.abs(np.asarray(lp) - np.log(probs[tok])).max() < 1e-5
        if keep.sum() > 1:  # the empirical distribution follows the kept probabilities
            freq = np.bincount(tok, minlength=V) / len(tok)
            assert np.abs(freq - probs).max() < 0.05


def test_two_level_sampling_over_a_large_vocabulary():
    """A vocabulary of several sampling blocks, the last one partial, half of it masked: draws
    come from unmasked tokens only, with their log-probs, at their probabilities; greedy rows
    take the argmax."""
    rng = np.random.RandomState(1)
    Vb = 5 * SAMPLE_BLOCK + 37
    x = (3.0 * rng.standard_normal(Vb)).astype(np.float32)
    x[rng.rand(Vb) < 0.5] = -np.inf
    big = [3, 700, 2 * SAMPLE_BLOCK + 1, Vb - 1]  # most of the mass, in four blocks
    x[big] = [12.0, 12.5, 11.5, 12.2]
    probs = np.exp(x.astype(np.float64) - x[np.isfinite(x)].max())
    probs /= probs.sum()
    n = 8000
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(3), n))
    temp = np.ones(n, np.float32)
    temp[:8] = 0.0
    tok, lp = jax.jit(_sample)(jnp.broadcast_to(jnp.asarray(x), (n, Vb)), keys, jnp.asarray(temp))
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert (tok[:8] == np.argmax(x)).all()
    tok, lp = tok[8:], lp[8:]
    assert np.isfinite(x[tok]).all()
    assert np.abs(lp - np.log(probs[tok])).max() < 1e-5
    freq = np.bincount(tok, minlength=Vb) / len(tok)
    assert np.abs(freq - probs).max() < 0.02
    assert freq[big].sum() > 0.5


# ---------------------------------------------------------------------------------------------
# (g) abort and interrupting weight updates


@contextlib.contextmanager
def _after_first_decode(engine, on_first):
    """Runs on_first() (in the generating thread) right after the engine's next decode chunk."""
    decode, fired = engine._decode, []

    def wrapped(*args):
        out = decode(*args)
        if not fired:
            fired.append(True)
            on_first()
        return out

    engine._decode = wrapped
    try:
        yield fired
    finally:
        engine._decode = decode


def test_abort_from_another_thread_returns_partial(engine):
    started, go = threading.Event(), threading.Event()

    def pause():
        started.set()
        assert go.wait(60)

    reqs = [_req(f"r{i}", _prompt(30 + i, 5), max_new_tokens=16, seed=i) for i in range(3)]
    result = {}
    with _after_first_decode(engine, pause):
        t = threading.Thread(target=lambda: result.setdefault("gens", engine.generate(reqs)))
        t.start()
        assert started.wait(60)
        engine.abort()  # from this thread, while the other one generates
        go.set()
        t.join(60)
    try:
        for g in result["gens"]:
            assert g.finish_reason == "abort"
            assert len(g.token_ids) == 1 + 4  # the prefill token and one decode chunk
            assert len(g.logprobs) == len(g.versions) == 5 and (g.versions == 0).all()
        later = engine.generate(reqs)  # until resume(), later calls return at once, empty
        assert all(g.finish_reason == "abort" and len(g.token_ids) == 0 for g in later)
    finally:
        engine.resume()
    full = engine.generate(reqs)
    for g, partial in zip(full, result["gens"]):
        assert g.finish_reason == "length" and len(g.token_ids) == 16
        np.testing.assert_array_equal(g.token_ids[:5], partial.token_ids)
        assert np.abs(g.logprobs[:5] - partial.logprobs).max() < 1e-5


@pytest.mark.slow
def test_interrupting_update_resubmits_on_new_weights(model, tok):
    """`continue` partial rollouts: tokens after the switch come from (and carry) version 1."""
    new_model = randomize(nnx.clone(model), seed=1)
    new_params = nnx.state(new_model, nnx.Param)
    eng = JaxEngine(model, chunk=4, update_mode="continue")
    updater = []

    def switch():  # a weight update from another thread, interrupting this generation
        t = threading.Thread(target=lambda: eng.update_weights(1, new_params).wait())
        t.start()
        updater.append(t)
        deadline = time.monotonic() + 60
        while not eng._interrupt.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.001)

    task = ArithmeticTask()
    problems = task.problems("train", 3)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    with _after_first_decode(eng, switch):
        eps = run_episodes(eng, task, tok, problems, params, seeds=[3, 4, 5])
    updater[0].join(60)
    assert eng.version == 1
    for e in eps:
        v = e.versions[e.loss_mask > 0]
        assert e.finish_reason == "length", e.finish_reason
        np.testing.assert_array_equal(v, [0] * 5 + [1] * 11)
        assert e.version_span == (0, 1)
    # Each token's behavior log-prob is that of the weights its version names.
    old_lp, behavior, versions = _learner_logp(model, eps, 1.0)
    new_lp, _, _ = _learner_logp(new_model, eps, 1.0)
    old, new = versions == 0, versions == 1
    assert np.abs(old_lp[old] - behavior[old]).max() < 1e-5
    assert np.abs(new_lp[new] - behavior[new]).max() < 1e-5
    assert np.abs(old_lp[new] - behavior[new]).max() > 1e-2  # the weights really differ


@pytest.mark.slow
def test_inflight_update_goes_on_under_new_weights_with_the_old_cache(model):
    """`inflight`: rows live at the update keep their slots; tokens after the switch carry
    version 1 and the log-probs they were sampled with: the new weights over a cache whose
    earlier entries the old weights wrote (checked against the model's own prefill/decode)."""
    new_model = randomize(nnx.clone(model), seed=1)
    eng = JaxEngine(model, chunk=4, update_mode="inflight")
    updater = []

    def switch():  # a weight update from another thread, landing after this chunk
        t = threading.Thread(
            target=lambda: eng.update_weights(1, nnx.state(new_model, nnx.Param)).wait()
        )
        t.start()
        updater.append(t)
        deadline = time.monotonic() + 60
        while not eng._installs:
            assert time.monotonic() < deadline
            time.sleep(0.001)

    reqs = [_req(f"f{i}", _prompt(70 + i, 3 + 2 * i), max_new_tokens=16, seed=i) for i in range(3)]
    with _after_first_decode(eng, switch):
        gens = eng.generate(reqs)
    updater[0].join(60)
    assert eng.version == 1
    prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
    decode = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    lsm = lambda x: np.asarray(jax.nn.log_softmax(x, axis=-1))[0]
    for r, g in zip(reqs, gens):
        assert g.finish_reason == "length" and len(g.token_ids) == 16
        np.testing.assert_array_equal(g.versions, [0] * 5 + [1] * 11)
        n = len(r.prompt_ids)
        cache = init_cache(model.config, 1, 32)
        logits, cache = prefill(model, jnp.asarray(r.prompt_ids[None]), jnp.asarray([n]), cache)
        want = [lsm(logits[:, n - 1])[g.token_ids[0]]]
        for i, t in enumerate(g.token_ids[:-1]):  # token i fed: its key/value by its weights
            m = model if g.versions[i + 1] == 0 else new_model
            logits, cache = decode(m, jnp.asarray([t]), jnp.asarray([n + i]), cache)
            want.append(lsm(logits)[g.token_ids[i + 1]])
        np.testing.assert_allclose(g.logprobs, want, rtol=0, atol=1e-5)
        old_only = _learner_logp(model, [_episode(r, g)], 1.0)[0]
        assert np.abs(old_only[5:] - g.logprobs[5:]).max() > 1e-2  # the weights really differ
    eng.close()


def _episode(r, g):
    """One Episode of a request and its Generation (no reward)."""
    n = len(r.prompt_ids)
    tokens = np.concatenate([r.prompt_ids, g.token_ids])
    mask = np.r_[np.zeros(n, np.int8), np.ones(len(g.token_ids), np.int8)]
    behavior = np.r_[np.zeros(n, np.float32), g.logprobs]
    versions = np.r_[np.full(n, -1, np.int32), g.versions]
    return Episode(r.request_id, tokens, mask, behavior, versions, n, 0.0)


def test_episode_version_span_ignores_environment_tokens():
    e = Episode(
        "p",
        np.arange(6),
        np.array([0, 1, 1, 0, 1, 0]),
        np.zeros(6),
        np.array([-1, 2, 3, -1, 3, -1]),
        prompt_len=1,
        reward=0.0,
    )
    assert e.version_span == (2, 3) and e.num_generated == 3


# ---------------------------------------------------------------------------------------------
# (h) continuous batching: slots refill, results stream out, drain across an update


def _mixed_requests(tag):
    """Two long and eight short requests: a static batch of 4 idles through the long ones."""
    budgets = [24, 3, 4, 2, 24, 5, 3, 4, 2, 6]
    return [
        _req(f"{tag}{i}", _prompt(40 + i, 3 + i % 5), max_new_tokens=n, seed=100 + i)
        for i, n in enumerate(budgets)
    ]


@pytest.mark.slow
def test_continuous_refills_freed_slots_with_the_same_results(model, engine):
    cont = JaxEngine(model, chunk=4, max_batch=4)
    static = JaxEngine(model, chunk=4, max_batch=4, continuous=False)
    reqs = _mixed_requests("m")
    out_c, out_s = cont.generate(reqs), static.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]  # each request by itself
    for c, s, a, r in zip(out_c, out_s, alone, reqs):
        assert len(c.token_ids) == r.params.max_new_tokens and c.finish_reason == "length"
        np.testing.assert_array_equal(c.token_ids, a.token_ids)
        np.testing.assert_array_equal(s.token_ids, a.token_ids)
        assert np.abs(c.logprobs - a.logprobs).max() < 1e-5
    # Continuous batching computes fewer slot-steps for the same tokens (refilled slots); the
    # static batches run until their longest row is done.
    tokens = sum(r.params.max_new_tokens - 1 for r in reqs)  # decode steps (first: prefill)
    assert cont.useful_steps == static.useful_steps == tokens
    assert cont.slot_steps < static.slot_steps
    assert cont.stats()["slot_occupancy"] > static.stats()["slot_occupancy"]
    cont.close(), static.close()


@pytest.mark.slow
def test_results_stream_out_while_a_long_row_runs(model):
    eng = JaxEngine(model, chunk=4, max_batch=4)
    done: dict[str, float] = {}

    def call(tag, n):
        eng.generate([_req(tag, _prompt(50, 4), max_new_tokens=n, seed=1)])
        done[tag] = time.monotonic()

    long_call = threading.Thread(target=call, args=("long", 200))
    long_call.start()
    deadline = time.monotonic() + 120
    while not any(eng._slots):  # until the long row holds a slot
        assert time.monotonic() < deadline
        time.sleep(0.005)
    call("short", 3)  # a second caller: admitted beside the long row, returned before it ends
    assert "long" not in done
    long_call.join(120)
    assert done["short"] < done["long"]
    eng.close()


def test_drain_update_lets_live_rows_finish_on_their_version(model, tok):
    """`drain`: rows live at the update finish on version 0; requests after it get version 1."""
    new_params = nnx.state(randomize(nnx.clone(model), seed=2), nnx.Param)
    eng = JaxEngine(model, chunk=4, update_mode="drain", background_install=True)
    handles = []
    reqs = [_req(f"d{i}", _prompt(60 + i, 5), max_new_tokens=16, seed=i) for i in range(3)]
    with _after_first_decode(eng, lambda: handles.append(eng.update_weights(1, new_params))):
        first = eng.generate(reqs)
    handles[0].wait(60)
    for g in first:
        assert g.finish_reason == "length" and len(g.token_ids) == 16 and (g.versions == 0).all()
    later = eng.generate(reqs)
    assert all((g.versions == 1).all() for g in later)
    assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(first, later))
    eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_no_decode_chunk_past_every_rows_budget(model, overlap):
    """A chunk starts only while some live row may still need a token: a budget of one ends at
    the prefill, and with a chunk in flight (overlap) none follows the one that reaches every
    row's budget. Stop tokens hit at the prefill end the row there too."""
    eng = JaxEngine(model, chunk=4, max_batch=4, early_exit=False, overlap=overlap)
    for budget, steps in [(1, 0), (2, 4), (5, 4), (6, 8), (13, 12)]:
        eng.slot_steps = 0
        reqs = [
            _req(f"b{budget}-{i}", _prompt(70 + i, 5), max_new_tokens=budget, seed=i)
            for i in range(4)
        ]
        out = eng.generate(reqs)
        assert [len(g.token_ids) for g in out] == [budget] * 4
        assert eng.slot_steps == 4 * steps, (budget, eng.slot_steps)
    first = eng.generate([_req("s", _prompt(80, 5), max_new_tokens=1, seed=3)])[0]
    eng.slot_steps = 0
    stop = int(first.token_ids[0])  # the same request's first token, now a stop token
    g = eng.generate([_req("s", _prompt(80, 5), max_new_tokens=9, seed=3, stop_token_ids=[stop])])
    assert g[0].finish_reason == "stop" and list(g[0].token_ids) == [stop]
    assert eng.slot_steps == 0
    eng.close()


@pytest.mark.parametrize("fixed_slots", [False, True])
def test_admissions_pad_to_powers_of_two_with_fixed_slots_too(model, fixed_slots):
    """A prefill's cost grows with its rows once it is compute-bound, on an accelerator too:
    seven freed slots are refilled by an 8-row prefill, not a 16-row one."""
    eng = JaxEngine(model, chunk=4, max_batch=64, fixed_slots=fixed_slots)
    assert [eng._admission_rows(n) for n in (1, 3, 7, 9, 33, 64)] == [1, 4, 8, 16, 64, 64]
    eng.close()
