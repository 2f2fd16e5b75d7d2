"""A test's count of what the JAX sampler decodes, from outside the system's own counters.

With this directory on PYTHONPATH and DECODE_TRACE=<file>, every Python process (the trainer
and its spawned rollout process alike) wraps JaxEngine.generate once rl.rollout.jax_engine is
imported, and appends a JSON line per request: the sha256 of its prompt ids, the prompt length,
the token budget it asked for, and how many tokens the sampler returned for it.
DECODE_CHUNK_SLEEP_S=<s> (a fake for timing) sleeps that long before each decode chunk, so a
test can make the real sampler slower than the learner.
"""

import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

TARGET = "rl.rollout.jax_engine"


def prompt_sha(ids) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()


def _wrap(module) -> None:
    path = os.environ.get("DECODE_TRACE")
    generate, dispatch = module.JaxEngine.generate, module.JaxEngine._dispatch
    pause = float(os.environ.get("DECODE_CHUNK_SLEEP_S") or 0)

    def slowed(self):
        time.sleep(pause)
        return dispatch(self)

    def traced(self, requests):
        out = generate(self, requests)
        lines = "".join(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "prompt_sha": prompt_sha(r.prompt_ids),
                    "prompt_len": len(r.prompt_ids),
                    "max_new": int(r.params.max_new_tokens),
                    "decoded": len(g.token_ids),
                    "reason": g.finish_reason,
                }
            )
            + "\n"
            for r, g in zip(requests, out)
        )
        with open(path, "a") as f:  # one write per call: lines of processes do not interleave
            f.write(lines)
        return out

    if path:
        module.JaxEngine.generate = traced
    if pause:
        module.JaxEngine._dispatch = slowed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


if os.environ.get("DECODE_TRACE") or os.environ.get("DECODE_CHUNK_SLEEP_S"):
    sys.meta_path.insert(0, _Finder())
