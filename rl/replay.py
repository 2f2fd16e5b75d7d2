"""Exact replay of a run: its recorded schedule (rl/schedule.py) re-run in one process.

replay() rebuilds the run from its config (warm start included), regenerates every trained
group span by span under the recorded versions' weights (kept while still needed), in one
process and one thread, applies the same updates in the same order and compares every loss,
reward and accuracy with the run's metrics.jsonl bit for bit. Log-probs are bit-for-bit only
from a batch-invariant sampler (rollout.batch_invariant), so replay needs it.
"""

from __future__ import annotations

import json
import os
import tempfile

from rl import config as C
from rl import staleness
from rl.schedule import digest, read_schedule, segments
from rl.types import EpisodeGroup

# Logged metrics a replay must reproduce exactly (times and engine counters differ).
COMPARED = (
    "loss/",
    "reward/",
    "episode/",
    "batch/",
    "partial/",
    "staleness/",
    "eval/accuracy",
    "eval/reward",
    "eval/formatted",
    "eval/length",
    "sft/loss",
)


class ScriptedEngine:
    """An engine for one episode: serves each generate call from its recorded span, under that
    span's version (weights switched as needed); an interrupted span ends as 'abort' after its
    recorded token count, as the original did."""

    def __init__(self, engine, weights: dict, spans: list[list[int]]):
        self.engine, self.weights, self.spans = engine, weights, list(spans)

    def generate(self, requests):
        import dataclasses

        (req,) = requests
        if not self.spans:
            raise ReplayMismatch("the regenerated episode asked for more spans than recorded")
        turn, version, n = self.spans.pop(0)
        more_in_turn = bool(self.spans) and self.spans[0][0] == turn
        if self.engine.version != version:
            self.engine.update_weights(version, self.weights[version])
        if more_in_turn:  # interrupted: the original returned these n tokens as 'abort'
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, max_new_tokens=n))
        (gen,) = self.engine.generate([req])
        if more_in_turn:
            gen = dataclasses.replace(gen, finish_reason="abort")
        return [gen]


class ReplayMismatch(RuntimeError):
    """The replay differs from the original run; the message names the first difference."""


def compare_row(step: int, original: dict, replayed: dict) -> None:
    """Raises ReplayMismatch at the first compared metric of `original` that `replayed` lacks
    or holds with other bits."""
    for k in sorted(original):
        if not k.startswith(COMPARED):
            continue
        if k not in replayed:
            raise ReplayMismatch(f"step {step}: {k} was logged ({original[k]!r}), not replayed")
        if original[k] != replayed[k]:
            raise ReplayMismatch(
                f"step {step}: {k} = {replayed[k]!r} in the replay, {original[k]!r} in the run"
            )


def replay(run_dir: str, work_dir: str | None = None, log=print) -> int:
    """Re-runs the run in run_dir from its schedule in this process; returns the number of
    values compared. Raises ReplayMismatch naming the first difference, C.ConfigError for a
    run that cannot be replayed."""
    import jax

    from rl import build, startup
    from rl.agent import run_episodes
    from rl.evaluate import evaluate
    from rl.learner_setup import make_learner
    from rl.metrics import update_row
    from rl.rollout.base import Weights
    from rl.rollout.jax_engine import JaxEngine
    from rl.sft import warm_start_run

    cfg = C.load(os.path.join(run_dir, "config.yaml"), [])
    startup.enable_cache(cfg.trainer.compile_cache)
    if not cfg.rollout.batch_invariant:
        raise C.ConfigError(
            "rollout.batch_invariant: false in this run; replay needs true (the sampler's "
            "log-probs are bit-for-bit only at fixed shapes)"
        )
    if cfg.trainer.transport != "local" or cfg.rollout.engine != "jax":
        raise C.ConfigError(
            f"trainer.transport {cfg.trainer.transport!r}, rollout.engine "
            f"{cfg.rollout.engine!r}: replay needs transport 'local' and engine 'jax'"
        )
    if cfg.learner.hosts > 1:
        raise C.ConfigError(
            f"learner.hosts: {cfg.learner.hosts} in this run; replay runs the learner in one "
            "process, whose sums are not bit-for-bit those of several hosts, so it replays only "
            "runs of learner.hosts 1"
        )
    schedule = read_schedule(run_dir)
    rewinds = [s for s in schedule if "rewind" in s]
    if rewinds:
        raise ReplayMismatch(f"the run's learner went back to version {rewinds[0]['rewind']}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = {}
        for line in f:
            row = json.loads(line)
            metrics.setdefault(row["step"], {}).update(row)
    task = build.make_task(cfg, build.make_tokenizer(cfg, run_dir)[1])
    tokenizer = task.tokenizer
    eval_problems = task.problems("eval", cfg.task.num_eval)
    work_dir = work_dir or tempfile.mkdtemp(prefix="replay-")
    _, learner, ckpt = make_learner(cfg, tokenizer.vocab_size, jax.devices(), work_dir)
    ckpt.close()
    summary: dict = {}
    if cfg.sft.steps > 0:
        summary.update(warm_start_run(cfg, learner, task, tokenizer)[0])
    row_len = build.row_length(cfg, task, tokenizer, eval_problems)
    engine = JaxEngine(
        learner.model,
        version=learner.version,
        max_batch=cfg.rollout.batch_size,
        deadline_s=cfg.trainer.deadline_s,
        update_mode=cfg.trainer.partial,
        cache_len=row_len,
        gemm_autotune=cfg.trainer.gemm_autotune,
    )
    needed: dict[int, int] = {}  # version -> the last update whose groups use it
    for s in schedule:
        for g in s.get("trained", []):
            for e in g["episodes"]:
                for _, v, _ in e["segments"]:
                    needed[v] = max(needed.get(v, 0), s["update"])
    weights: dict[int, Weights] = {}

    def keep(version: int) -> None:
        if version in needed:
            weights[version] = Weights(flat=learner.weights().flat())

    compared = 0
    controller, eta = staleness.from_config(cfg), build.effective_eta(cfg)
    try:
        keep(learner.version)
        train_problems = task.problems("train", 64)
        greedy, sampling = build.sampling(cfg, greedy=True), build.sampling(cfg)
        unit = build.pack_unit(cfg)
        for s in schedule:
            if "start" in s:
                row = {**summary, **evaluate(engine, task, tokenizer, eval_problems, greedy)}
                row["eval/accuracy_start"] = row["eval/accuracy"]
                compare_row(0, metrics.get(0, {}), row)
                compared += 1
                continue
            v_new = s["update"]
            groups = []
            for g in s["trained"]:
                gid = g["group"]
                if gid >= len(train_problems):
                    train_problems = task.problems("train", 2 * (gid + 1) + 64)
                problem = train_problems[gid]
                if problem.id != g["problem"]:
                    raise ReplayMismatch(f"group {gid}: problem {problem.id}, run {g['problem']}")
                eps = []
                for i, (seed, rec) in enumerate(zip(g["seeds"], g["episodes"])):
                    scripted = ScriptedEngine(engine, weights, rec["segments"])
                    (e,) = run_episodes(
                        scripted, task, tokenizer, [problem], sampling, seeds=[seed]
                    )
                    if digest(e) != rec["digest"] or scripted.spans:
                        raise ReplayMismatch(
                            f"update {v_new}: group {gid} episode {i} regenerated differently "
                            f"(tokens {e.tokens[e.prompt_len :].tolist()}, spans "
                            f"{segments(e)}, recorded {rec['segments']})"
                        )
                    eps.append(e)
                groups.append(EpisodeGroup(gid, problem.id, tuple(eps), g["dispatch_version"]))
            batch = build.update_batch(cfg, groups, row_len=row_len, unit=unit)
            version = learner.version
            met = learner.update(batch, minibatches=cfg.learner.minibatches)
            if learner.version != v_new:
                raise ReplayMismatch(f"update made version {learner.version}, run {v_new}")
            row, _ = update_row(groups, batch, met, version)
            row["staleness/bound"] = float(eta)
            if controller is not None:  # the decision again, from the replayed drift
                eta = controller.observe(row)
                row["staleness/eta"] = float(eta)
            if s.get("eta", eta) != eta:
                raise ReplayMismatch(f"update {v_new}: staleness bound {eta}, run {s['eta']}")
            if s["eval"]:
                engine.update_weights(v_new, learner.weights())
                row.update(evaluate(engine, task, tokenizer, eval_problems, greedy))
            compare_row(v_new, metrics.get(v_new, {}), row)
            compared += 1
            keep(v_new)
            for v in [v for v in weights if needed[v] <= v_new]:
                del weights[v]  # no later group uses it
            log(f"update {v_new}: {len(groups)} groups regenerated, metrics equal")
    finally:
        engine.close()
    return compared
