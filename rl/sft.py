"""The supervised warm start: the task's demonstrations, trained before RL."""

from __future__ import annotations

import time

import numpy as np

from rl import build
from rl.buffer import Stopped
from rl.learner import StepConfig, make_batch
from rl.learner_setup import rl_optimizer, rl_step_cfg, sft_optimizer
from rl.types import Episode


def demo_episode(task, tokenizer, problem) -> Episode:
    """A demonstration as an episode: completion tokens trained, tool responses masked."""
    prompt = tokenizer.encode(problem.prompt)
    comp = tokenizer.encode(task.demonstration(problem)) + [tokenizer.end_ids[0]]
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
    learner,
    task,
    tokenizer,
    sft,
    *,
    rl_step: StepConfig,
    sft_tx=None,
    rl_tx=None,
    stop=None,
    probe=None,
):
    """Runs sft.steps supervised steps, then leaves the learner at version 0 on the RL step.

    sft_tx / rl_tx: fresh optimizers for the two stages (None: one optimizer continues).
    stop(): checked between steps; when it returns a reason, Stopped(reason) is raised.
    probe(): greedy accuracy of the current weights on training problems; with
    sft.target_accuracy > 0 it runs every sft.check_every steps and the warm start ends once it
    reaches the target (sft.steps is then the cap).
    Returns (summary metrics, loss curve [(step, loss)]).
    """
    learner.set_step_cfg(StepConfig(loss="sft", temperature=1.0))
    if sft_tx is not None:
        learner.reset_optimizer(sft_tx)
    problems = task.problems("train", sft.steps * sft.batch_size)
    demos = [demo_episode(task, tokenizer, p) for p in problems]
    # One row length for the whole warm start (one program): the longest demonstration's
    # targets, no more (padding to a bucket would be up to half the warm start's compute)
    row_len = max(len(e.tokens) for e in demos) - 1
    t0 = time.perf_counter()
    loss = float("nan")
    curve: list[tuple[int, float]] = []
    target = sft.target_accuracy
    if target and probe is None:
        raise ValueError("sft.target_accuracy > 0 needs a probe of the warm start's accuracy")
    steps, accuracy = sft.steps, None
    for step in range(sft.steps):
        if stop is not None and stop():
            raise Stopped(stop())
        eps = demos[step * sft.batch_size : (step + 1) * sft.batch_size]
        # Not waited for: the next batch is made while this step runs; the loss is read rarely
        met = learner.update(make_batch(eps, np.zeros(len(eps)), row_len=row_len), wait=False)
        if step % 25 == 0 or step == sft.steps - 1:
            loss = float(met["loss"])
            curve.append((step, loss))
        if target and (step + 1) % sft.check_every == 0:
            accuracy = probe()
            if accuracy >= target:
                steps, loss = step + 1, float(met["loss"])
                break
    learner.version = 0
    learner.set_step_cfg(rl_step)
    if rl_tx is not None:
        learner.reset_optimizer(rl_tx)
    summary = {"sft/loss": loss, "sft/time": time.perf_counter() - t0, "sft/steps": steps}
    if accuracy is not None:
        summary["sft/probe_accuracy"] = accuracy
    return summary, curve


def accuracy_probe(cfg, learner, task, tokenizer):
    """(probe(), close()): greedy accuracy of the learner's current weights on
    cfg.sft.probe_size training problems (past the warm start's own), in an in-process sampler."""
    from rl.evaluate import evaluate

    engine = build.make_eval_engine(cfg, learner)
    n = cfg.sft.steps * cfg.sft.batch_size
    problems = task.problems("train", n + cfg.sft.probe_size)[n:]
    params = build.sampling(cfg, greedy=True)
    calls = [0]

    def probe() -> float:
        calls[0] += 1
        engine.update_weights(calls[0], learner.weights())
        return evaluate(engine, task, tokenizer, problems, params)["eval/accuracy"]

    return probe, engine.close


def warm_start_run(cfg, learner, task, tokenizer, stop=None):
    """The run's warm start (cfg.sft), with the run's optimizers for both stages."""
    fresh = not cfg.sft.continue_optimizer
    probe, close = (None, None)
    if cfg.sft.target_accuracy:
        probe, close = accuracy_probe(cfg, learner, task, tokenizer)
    try:
        return warm_start(
            learner,
            task,
            tokenizer,
            cfg.sft,
            rl_step=rl_step_cfg(cfg),
            sft_tx=sft_optimizer(cfg) if fresh else None,
            rl_tx=rl_optimizer(cfg) if fresh else None,
            stop=stop,
            probe=probe,
        )
    finally:
        if close is not None:
            close()
