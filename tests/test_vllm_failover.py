"""VLLMEngine's dispatch over several hosts, failover, partial update failures and the continue
mode, against small fake vLLM servers (the HTTP contract only, no model): fast and unmarked."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
from vllm_helpers import PROMPTS, requests_for, run_in_thread, sha256

from rl.rollout.base import Weights
from rl.rollout.vllm import VLLMEngine
from rl.rollout.vllm_host import VLLMError


class FakeVLLM:
    """A stand-in for vLLM's HTTP API: emits token (last prompt id + i + 1) % 128 every
    `token_s` seconds with log-prob -0.5, honours /abort_requests, logs every call."""

    def __init__(self, token_s: float = 0.002, fail_reload: bool = False, drop: int = 0):
        import http.server

        self.token_s, self.fail_reload = token_s, fail_reload
        self.drop = drop  # completions answered by closing the connection, no response
        self.stopped = threading.Event()  # set: every call waits until cleared (as SIGSTOP)
        self.calls: list[str] = []
        self.prompts: list[list[int]] = []
        self.version, self.abort_epoch, self.active, self.max_active = "default", 0, 0, 0
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.hold()
                fake.calls.append(self.path)
                if self.path == "/weight_info":
                    return self.reply(200, {"weight_version": fake.version})
                self.reply(200, {})

            def do_POST(self):
                fake.hold()
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                fake.calls.append(self.path)
                if self.path == "/v1/completions":
                    with fake.lock:
                        dropped, fake.drop = fake.drop > 0, max(fake.drop - 1, 0)
                    if dropped:  # as a server closing a reused keep-alive connection
                        self.close_connection = True
                        return
                    return self.reply(200, fake.complete(body))
                if self.path == "/update_weight_version":
                    fake.version = body["new_version"]
                elif self.path == "/abort_requests":
                    with fake.lock:
                        fake.abort_epoch += 1
                elif self.path == "/collective_rpc" and fake.fail_reload:
                    return self.reply(500, {"error": "reload failed"})
                self.reply(200, {"results": [None]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self):
        """Blocks the calling handler while the fake is stopped (bounded: a test's cleanup)."""
        end = time.monotonic() + 60
        while self.stopped.is_set() and time.monotonic() < end:
            time.sleep(0.01)

    def complete(self, body) -> dict:
        with self.lock:
            epoch = self.abort_epoch
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.prompts.append(body["prompt"])
        tokens, finish = [], "length"
        for i in range(body["max_tokens"]):
            time.sleep(self.token_s)
            if self.abort_epoch != epoch:
                finish = "abort"
                break
            tokens.append((body["prompt"][-1] + i + 1) % 128)
        with self.lock:
            self.active -= 1
        logprobs = {
            "token_logprobs": [-0.5] * len(tokens),
            "tokens": [f"token_id:{t}" for t in tokens],
        }
        return {"choices": [{"token_ids": tokens, "logprobs": logprobs, "finish_reason": finish}]}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def fake_weights_dir(root, version: int) -> str:
    """A published dir that passes the manifest checks (the fake server never reads it)."""
    path = os.path.join(root, f"v{version:06d}")
    os.makedirs(path)
    for name, data in (
        ("config.json", '{"tie_word_embeddings": false}'),
        ("model.safetensors", "x"),
    ):
        with open(os.path.join(path, name), "w") as f:
            f.write(data)
    files = {n: sha256(os.path.join(path, n)) for n in ("config.json", "model.safetensors")}
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({"version": version, "files": files}, f)
    return path


def expected_tokens(prompt, n) -> list[int]:
    return [(prompt[-1] + i + 1) % 128 for i in range(n)]


def test_dispatch_spreads_over_hosts_and_survives_a_dead_one():
    a, b = FakeVLLM(), FakeVLLM()
    engine = VLLMEngine([a.url, b.url], version=3, deadline_s=30)
    try:
        gens = engine.generate(requests_for(PROMPTS * 2, "spread", max_new_tokens=20))
        served = (len(a.prompts), len(b.prompts))
        assert sum(served) == 8 and min(served) >= 3, served  # least-loaded: about 4 and 4
        for p, g in zip(PROMPTS * 2, gens):
            assert g.token_ids.tolist() == expected_tokens(p, 20)
            assert (g.versions == 3).all() and (g.logprobs == -0.5).all()

        b.close()  # connection refused from now on
        gens = engine.generate(requests_for(PROMPTS, "failover", max_new_tokens=5))
        assert all(g.token_ids.tolist() == expected_tokens(p, 5) for p, g in zip(PROMPTS, gens))
        assert engine.health() == {a.url: True, b.url: False}
    finally:
        engine.close()
        a.close()


def test_connection_closed_without_response_is_retried_on_a_healthy_host():
    """A request that dies with its connection ("Remote end closed connection without
    response", a server closing a reused keep-alive connection) is retried; the host, which
    still answers /health, stays healthy."""
    a = FakeVLLM(drop=2)
    engine = VLLMEngine([a.url], version=1, max_retries=3, deadline_s=30)
    try:
        gens = engine.generate(requests_for(PROMPTS, "dropped", max_new_tokens=5))
        assert all(g.token_ids.tolist() == expected_tokens(p, 5) for p, g in zip(PROMPTS, gens))
        assert a.calls.count("/v1/completions") == len(PROMPTS) + 2
        assert engine.health() == {a.url: True}
    finally:
        engine.close()
        a.close()


def test_partial_update_failure_marks_host_unhealthy(tmp_path):
    good, bad = FakeVLLM(), FakeVLLM(fail_reload=True)
    engine = VLLMEngine([good.url, bad.url], version=0, max_retries=2, deadline_s=30)
    try:
        good.calls.clear()
        engine.update_weights(1, fake_weights_dir(tmp_path, 1))
        assert engine.version == 1 and engine.host_versions == {good.url: 1, bad.url: 0}
        assert good.calls == [
            "/health",
            "/pause?mode=abort",
            "/collective_rpc",
            "/update_weight_version",
            "/weight_info",
            "/reset_prefix_cache",
            "/resume",
        ]
        assert bad.calls.count("/collective_rpc") == 3  # tried 1 + max_retries times
        before = len(bad.prompts)
        gens = engine.generate(requests_for(PROMPTS, "after", max_new_tokens=4))
        assert len(bad.prompts) == before  # nothing goes to the host with unknown weights
        assert all((g.versions == 1).all() for g in gens)
        assert engine.health() == {good.url: True, bad.url: False}

        only_bad = VLLMEngine([bad.url], version=0)
        with pytest.raises(VLLMError, match="no vLLM host loaded version 2"):
            only_bad.update_weights(2, fake_weights_dir(tmp_path, 2))
        assert only_bad.version == 0
        only_bad.close()
    finally:
        engine.close()
        good.close()
        bad.close()


def test_continue_mode_resubmits_the_prefix_on_the_new_version(tmp_path):
    fake = FakeVLLM(token_s=0.005)
    engine = VLLMEngine([fake.url], version=0, update_mode="continue", deadline_s=30)
    try:
        prompt = PROMPTS[1]
        thread, box = run_in_thread(
            lambda: engine.generate(requests_for([prompt], "cont", max_new_tokens=200))
        )
        time.sleep(0.3)
        engine.update_weights(1, fake_weights_dir(tmp_path, 1))
        thread.join(timeout=30)
        (gen,) = box["result"]
        k = int(np.sum(gen.versions == 0))
        assert gen.finish_reason == "length" and 0 < k < 200
        assert gen.versions.tolist() == [0] * k + [1] * (200 - k)
        assert gen.token_ids.tolist() == expected_tokens(prompt, 200)
        assert fake.prompts == [prompt, prompt + gen.token_ids[:k].tolist()]  # prefix resent
        assert fake.calls.index("/abort_requests") < fake.calls.index("/collective_rpc")
    finally:
        engine.close()
        fake.close()


@pytest.mark.slow
def test_fake_stopped_host_is_found_by_its_deadline_and_its_requests_go_to_the_other(tmp_path):
    """A host that stops answering (the fake holds every call, as a SIGSTOPped server would):
    its requests time out after request_timeout_s, /health does not answer either, so it is
    marked unhealthy and they complete on the other host; a weight update skips it without
    waiting for it, and once it answers again an update reloads it and takes it back."""
    a, b = FakeVLLM(token_s=0.01), FakeVLLM(token_s=0.01)
    engine = VLLMEngine([a.url, b.url], version=0, request_timeout_s=2, deadline_s=60)
    try:
        b.stopped.set()
        t0 = time.monotonic()
        gens = engine.generate(requests_for(PROMPTS, "hung", max_new_tokens=5))
        took = time.monotonic() - t0
        assert all(g.token_ids.tolist() == expected_tokens(p, 5) for p, g in zip(PROMPTS, gens))
        assert took < 2 + 5 + 5, took  # request timeout, then the /health probe
        assert engine.stats()["hosts_healthy"] == 1
        t0 = time.monotonic()
        engine.update_weights(1, fake_weights_dir(tmp_path, 1))
        assert time.monotonic() - t0 < 5 + 3  # the probe's deadline, not update_timeout_s
        assert engine.host_versions == {a.url: 1, b.url: 0}
        b.stopped.clear()
        engine.update_weights(2, fake_weights_dir(tmp_path, 2))
        assert engine.host_versions == {a.url: 2, b.url: 2}
        assert engine.stats()["hosts_healthy"] == 2
    finally:
        b.stopped.clear()
        engine.close()
        a.close()
        b.close()


def test_a_damaged_published_directory_is_refused_and_written_again(tmp_path):
    """A shard damaged after its manifest was written fails the sha256 check before any host
    reloads it: the engine has the Weights write the directory again and loads that; a plain
    directory (no maker) is refused with the error naming the file."""
    fake = FakeVLLM()
    engine = VLLMEngine([fake.url], version=0, deadline_s=30)
    writes = []

    def make_path():
        path = fake_weights_dir(tmp_path / f"w{len(writes)}", 1)
        if not writes:  # the first write is damaged after the manifest went down
            with open(os.path.join(path, "model.safetensors"), "w") as f:
                f.write("y")
        writes.append(path)
        return path

    try:
        engine.update_weights(1, Weights(make_path=make_path))
        assert len(writes) == 2 and engine.host_versions == {fake.url: 1}
        assert len(engine.refused) == 1 and "sha256 of" in engine.refused[0]
        assert fake.calls.count("/collective_rpc") == 1  # only the good directory was loaded
        with pytest.raises(VLLMError, match="model.safetensors.*does not match"):
            engine.update_weights(1, writes[0])  # the damaged one, as a plain path
        assert engine.host_versions == {fake.url: 1}
    finally:
        engine.close()
        fake.close()
