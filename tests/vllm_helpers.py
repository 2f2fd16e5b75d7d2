"""Helpers shared by the vLLM tests: request lists, a thread runner, file hashes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time

import numpy as np

from rl.rollout.base import GenerationRequest, SamplingParams

PROMPTS = [[20, 21, 22], [30, 31, 32, 33, 34], [40], [50, 51, 52, 53, 54, 55, 56, 57]]


def sha256(path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def requests_for(prompts, tag: str, **params) -> list[GenerationRequest]:
    """One request per prompt (token id lists), ids tagged, the same sampling params."""
    return [
        GenerationRequest(f"{tag}-{i}", np.asarray(p, np.int32), SamplingParams(**params))
        for i, p in enumerate(prompts)
    ]


def run_in_thread(fn):
    """Starts fn() in a thread; returns (thread, box) where box gets 'result' or 'error'."""
    box: dict = {}

    def target():
        t0 = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        box["seconds"] = time.monotonic() - t0
        box["end"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def publish_v0(trainer, root: str):
    """Version 0 of a trainer's learner published under root/weights: (server, its path)."""
    from rl.param_server import ParamServer

    server = ParamServer(
        os.path.join(root, "weights"),
        trainer.learner.model.config,
        tokenizer_dir=trainer.tok_dir,
        hf_overrides={"eos_token_id": trainer.tokenizer.eos_id},
    )
    path0, _ = server.write(0, trainer.learner.params())
    return server, path0


@contextlib.contextmanager
def serving(path: str, root: str, deadline_s: float = 600):
    """A vLLM host launched on a published directory (log at root/vllm.log), ready; stopped
    on exit."""
    from rl.rollout.vllm_host import VLLMHost

    host = VLLMHost.launch(path, log_path=os.path.join(root, "vllm.log"), max_model_len=512)
    try:
        host.wait_ready(deadline_s=deadline_s)
        yield host
    finally:
        host.stop()
