"""The supervised warm start: the task's demonstrations, trained before RL."""

from __future__ import annotations

import time

import numpy as np

from rl import build
from rl.buffer import Stopped
from rl.learner import StepConfig, bucket, make_batch
from rl.types import Episode


def demo_episode(task, tokenizer, problem) -> Episode:
    """A demonstration as an episode: completion tokens trained, tool responses masked."""
    prompt = tokenizer.encode(problem.prompt)
    comp = tokenizer.encode(task.demonstration(problem)) + [tokenizer.eos_id]
    mask = np.ones(len(comp), np.int8)
    open_id = close_id = None
    try:
        open_id = tokenizer.token_id("<tool_response>")
        close_id = tokenizer.token_id("</tool_response>")
    except KeyError:
        pass
    inside = False
    for i, t in enumerate(comp):  # environment text is not the model's to learn
        if t == open_id:
            inside = True
        if inside:
            mask[i] = 0
        if t == close_id:
            inside = False
    n = len(prompt) + len(comp)
    return Episode(
        problem.id,
        np.asarray(prompt + comp, np.int32),
        np.concatenate([np.zeros(len(prompt), np.int8), mask]),
        np.zeros(n, np.float32),
        np.full(n, -1, np.int32),
        len(prompt),
        reward=1.0,
    )


def warm_start(
    learner, task, tokenizer, sft, *, rl_step: StepConfig, sft_tx=None, rl_tx=None, stop=None
):
    """Runs sft.steps supervised steps, then leaves the learner at version 0 on the RL step.

    sft_tx / rl_tx: fresh optimizers for the two stages (None: one optimizer continues).
    stop(): checked between steps; when it returns a reason, Stopped(reason) is raised.
    Returns (summary metrics, loss curve [(step, loss)]).
    """
    learner.set_step_cfg(StepConfig(loss="sft", temperature=1.0))
    if sft_tx is not None:
        learner.reset_optimizer(sft_tx)
    problems = task.problems("train", sft.steps * sft.batch_size)
    row_len = None
    t0 = time.perf_counter()
    loss = float("nan")
    curve: list[tuple[int, float]] = []
    for step in range(sft.steps):
        if stop is not None and stop():
            raise Stopped(stop())
        chunk = problems[step * sft.batch_size : (step + 1) * sft.batch_size]
        eps = [demo_episode(task, tokenizer, p) for p in chunk]
        if row_len is None:
            row_len = bucket(max(len(e.tokens) for e in eps) + 8)
        met = learner.update(make_batch(eps, np.zeros(len(eps)), row_len=row_len))
        loss = met["loss"]
        if step % 25 == 0 or step == sft.steps - 1:
            curve.append((step, loss))
    learner.version = 0
    learner.set_step_cfg(rl_step)
    if rl_tx is not None:
        learner.reset_optimizer(rl_tx)
    summary = {"sft/loss": loss, "sft/time": time.perf_counter() - t0, "sft/steps": sft.steps}
    return summary, curve


def warm_start_run(cfg, learner, task, tokenizer, stop=None):
    """The run's warm start (cfg.sft), with the run's optimizers for both stages."""
    fresh = not cfg.sft.continue_optimizer
    return warm_start(
        learner,
        task,
        tokenizer,
        cfg.sft,
        rl_step=build.rl_step_cfg(cfg),
        sft_tx=build.sft_optimizer(cfg) if fresh else None,
        rl_tx=build.rl_optimizer(cfg) if fresh else None,
        stop=stop,
    )
