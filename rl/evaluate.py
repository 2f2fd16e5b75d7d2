"""Held-out evaluation: the current policy decodes the eval split (greedy by default), and,
when asked, k samples per problem for pass@1, pass@k and maj@k."""

from __future__ import annotations

import collections
import time

import numpy as np

from rl.agent import run_episodes
from rl.rollout.base import WorkerLost


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


def evaluate_held_out(engine, task, tokenizer, problems, greedy, sampled=None, k: int = 0) -> dict:
    """evaluate() with `greedy` params, and with k > 0 also evaluate_sampled() of k samples with
    `sampled` params. An evaluation whose rollout process was lost runs again on the replacement
    (each loss uses one of the engine's limited replacements)."""
    while True:
        try:
            out = evaluate(engine, task, tokenizer, problems, greedy)
            if k:
                out.update(evaluate_sampled(engine, task, tokenizer, problems, sampled, k))
            return out
        except WorkerLost:
            continue


def evaluate_sampled(engine, task, tokenizer, problems, params, k: int) -> dict:
    """k sampled completions of each problem (`params`: the rollout's temperature): pass@1 (the
    mean correctness of a sample), pass@k (some sample correct) and maj@k (the commonest final
    answer, rl.rewards.final_answer, is a correct one; no answer never wins a vote)."""
    from rl.rewards import final_answer
    from rl.tasks.base import strip_end_markers

    t0 = time.perf_counter()
    many = [p for p in problems for _ in range(k)]
    seeds = [1_000_003 * (i // k) + i % k for i in range(len(many))]
    eps = run_episodes(engine, task, tokenizer, many, params, seeds=seeds)
    correct = np.array([e.correct for e in eps], bool).reshape(len(problems), k)
    majority = []
    for i in range(len(problems)):
        group = eps[i * k : (i + 1) * k]
        answers = [final_answer(strip_end_markers(e.completion_text)) for e in group]
        votes = collections.Counter(a.strip() for a in answers if a is not None and a.strip())
        if not votes:
            majority.append(False)
            continue
        top = votes.most_common(1)[0][0]
        majority.append(any(c for a, c in zip(answers, correct[i]) if a and a.strip() == top))
    return {
        "eval/pass@1": float(correct.mean()),
        f"eval/pass@{k}": float(correct.any(axis=1).mean()),
        f"eval/maj@{k}": float(np.mean(majority)),
        "timing/eval_sampled": time.perf_counter() - t0,
    }
