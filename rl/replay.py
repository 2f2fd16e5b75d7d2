"""Exact replay of a run: the schedule an async run records, and its re-run in one process.

The trainer writes run_dir/schedule.jsonl, one JSON object a line: {"start": v, "eval": true}
first, then per update {"update": v (the new version), "eval": bool, "trained": [group, ...],
"skipped": [group, ...]}, where a group is {"group", "problem", "dispatch_version", "seeds",
"why" (skipped: filtered, dropped or lost), "episodes": [{"segments": [[turn, version,
tokens], ...], "digest"}]}: each episode's generated spans (a turn split where a weight update
interrupted it: each span under the version that made it) and a digest of its tokens, log-probs
and versions. replay() rebuilds the run from its config (warm start included), regenerates every
trained group span by span under the recorded versions' weights (kept while still needed), in
one process and one thread, applies the same updates in the same order and compares every loss,
reward and accuracy with the run's metrics.jsonl bit for bit. Log-probs are bit-for-bit only
from a batch-invariant sampler (rollout.batch_invariant), so replay needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from rl import config as C
from rl.types import Episode, EpisodeGroup

SCHEDULE = "schedule.jsonl"
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


def digest(e: Episode) -> str:
    """A digest of an episode's tokens, loss mask, behavior log-probs and versions."""
    h = hashlib.sha256()
    for a in (e.tokens, e.loss_mask, e.behavior_logp, e.versions):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def segments(e: Episode) -> list[list[int]]:
    """[[turn, version, tokens], ...]: the episode's generated spans, one per engine call (a
    turn is split where its version changes: a weight update interrupted it)."""
    out: list[list[int]] = []
    turn, prev_gen = -1, False
    for t in range(e.prompt_len, len(e.tokens)):
        gen = bool(e.loss_mask[t])
        if gen and not prev_gen:
            turn += 1
        if gen:
            v = int(e.versions[t])
            if out and out[-1][0] == turn and out[-1][1] == v and prev_gen:
                out[-1][2] += 1
            else:
                out.append([turn, v, 1])
        prev_gen = gen
    return out


def group_record(g: EpisodeGroup, seeds, why: str | None = None) -> dict:
    """One group of the schedule (JSON-able)."""
    rec = {
        "group": g.group_id,
        "problem": g.problem_id,
        "dispatch_version": g.dispatch_version,
        "seeds": [int(s) for s in seeds],
        "episodes": [{"segments": segments(e), "digest": digest(e)} for e in g.episodes],
    }
    if why is not None:
        rec["why"] = why
    return rec


class ScheduleWriter:
    """Appends the schedule of a run to run_dir/schedule.jsonl (line-buffered, one line per
    update). On resume from a checkpoint at `resume` the updates after it are cut."""

    def __init__(self, run_dir: str, seeds, resume: int | bool = False):
        self.path = os.path.join(run_dir, SCHEDULE)
        self.seeds = seeds  # group number -> its episode seeds
        self.skipped: list[dict] = []
        if resume is not False and os.path.exists(self.path):
            with open(self.path) as f:
                keep = [ln for ln in f if json.loads(ln).get("update", 0) <= int(resume)]
            with open(self.path, "w") as f:
                f.writelines(keep)
        elif resume is False:
            open(self.path, "w").close()

    def _write(self, obj: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")

    def start(self, version: int) -> None:
        """The evaluation before the first update."""
        self._write({"start": version, "eval": True})

    def skip(self, g: EpisodeGroup, why: str) -> None:
        """A group consumed without training (filtered, dropped or lost)."""
        self.skipped.append(group_record(g, self.seeds(g.group_id), why))

    def update(self, version: int, groups: list[EpisodeGroup], evaluated: bool) -> None:
        """The update that made `version`: the groups it trained, in order."""
        trained = [group_record(g, self.seeds(g.group_id)) for g in groups]
        skipped, self.skipped = self.skipped, []
        self._write({"update": version, "eval": evaluated, "trained": trained, "skipped": skipped})

    def rewind(self, version: int) -> None:
        """A learner restart went back to `version`: a replay cannot follow it."""
        self._write({"rewind": version})


def read_schedule(run_dir: str) -> list[dict]:
    """The schedule of a run, in order."""
    path = os.path.join(run_dir, SCHEDULE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no schedule; the run predates replay or is not a run")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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

    from rl import build
    from rl.agent import run_episodes
    from rl.evaluate import evaluate
    from rl.metrics import update_row
    from rl.rollout.base import Weights
    from rl.rollout.jax_engine import JaxEngine
    from rl.sft import warm_start_run

    cfg = C.load(os.path.join(run_dir, "config.yaml"), [])
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
    _, learner, ckpt = build.make_learner(cfg, tokenizer.vocab_size, jax.devices(), work_dir)
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
            row["staleness/bound"] = float(build.effective_eta(cfg))
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
