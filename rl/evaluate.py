"""Held-out evaluation: the current policy decodes the eval split (greedy by default)."""

from __future__ import annotations

import time

import numpy as np

from rl.agent import run_episodes


def evaluate(engine, task, tokenizer, problems, params) -> dict:
    """eval/accuracy, eval/reward, eval/formatted, eval/length over `problems`."""
    t0 = time.perf_counter()
    eps = run_episodes(engine, task, tokenizer, problems, params, seeds=list(range(len(problems))))
    return {
        "eval/accuracy": float(np.mean([e.correct for e in eps])),
        "eval/reward": float(np.mean([e.reward for e in eps])),
        "eval/formatted": float(np.mean([e.formatted for e in eps])),
        "eval/length": float(np.mean([e.num_generated for e in eps])),
        "timing/eval": time.perf_counter() - t0,
    }
