"""The schedule an async run records for an exact replay (rl/replay.py re-runs it).

The trainer writes run_dir/schedule.jsonl, one JSON object a line: {"start": v, "eval": true}
first, then per update {"update": v (the new version), "eval": bool, "eta": the staleness
bound after it (fixed, or set by adaptive staleness), "trained": [group, ...],
"skipped": [group, ...]}, where a group is {"group", "problem", "dispatch_version", "seeds",
"why" (skipped: filtered, dropped or lost), "episodes": [{"segments": [[turn, version,
tokens], ...], "digest"}]}: each episode's generated spans (a turn split where a weight update
interrupted it: each span under the version that made it) and a digest of its tokens, log-probs
and versions. A learner restart appends {"rewind": v}.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from rl.types import Episode, EpisodeGroup

SCHEDULE = "schedule.jsonl"


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

    def update(self, version: int, groups: list[EpisodeGroup], evaluated: bool, eta: int) -> None:
        """The update that made `version`: the groups it trained, in order, and the staleness
        bound the admissions after it run under."""
        trained = [group_record(g, self.seeds(g.group_id)) for g in groups]
        skipped, self.skipped = self.skipped, []
        rec = {"update": version, "eval": evaluated, "eta": eta}
        self._write({**rec, "trained": trained, "skipped": skipped})

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
