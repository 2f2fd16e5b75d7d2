"""A task from the user's data files: JSONL or Parquet rows (read with pyarrow), scored by rewards
chosen by name or import path (rl.rewards).

A row holds a prompt (a string, or a chat `messages` list of {role, content}), an answer, and
optionally a solution (the warm start's demonstration). Field names are options; dotted names
reach into nested columns, so verl's Parquet layout (`prompt` messages,
`reward_model.ground_truth`, `data_source`, `extra_info`) loads as it is. Without eval files a
held-out fraction is chosen by a hash of the normalised prompt, so duplicate prompts land on one
side; with them, training rows whose prompt is also held out are dropped (and counted). Every
row is checked when the task is made: a bad one is an error naming the file, the row and the
field, never a crash mid-run.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import sys
from typing import Any, ClassVar

from rl.config_rules import ConfigError
from rl.tasks.base import Problem, RewardResult, as_tuple, register_task, unit_hash

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
ANSWER_FIELDS = ("answer", "reward_model.ground_truth")  # tried in order when answer_field is ""
_SPACE = re.compile(r"\s+")


class DataError(ConfigError):
    """A data file or row that the task cannot use (names the file, row and field)."""


def read_rows(path: str) -> list[dict]:
    """The rows of one JSONL (one object per line) or Parquet file, as Python dicts."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise DataError(f"{path}: unknown file type {ext!r}; valid: {', '.join(FORMATS)}")
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist")
    import pyarrow as pa

    try:
        if FORMATS[ext] == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            import pyarrow.json as pj

            table = pj.read_json(path)
    except (pa.ArrowInvalid, OSError) as e:  # a malformed line, mixed types, a broken file
        raise DataError(f"{path}: cannot read: {e}") from None
    return table.to_pylist()


def field(row: dict, name: str) -> Any:
    """row[name], following dots into nested mappings; KeyError if absent."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def normalise(prompt: str | tuple) -> str:
    """The text that decides a prompt's split: contents joined, lower case, spaces collapsed."""
    if not isinstance(prompt, str):
        prompt = "\n".join(m["content"] for m in prompt)
    return _SPACE.sub(" ", prompt).strip().lower()


@dataclasses.dataclass(frozen=True)
class Row:
    """One checked data row."""

    prompt: str | tuple  # a string, or a tuple of {role, content} messages
    answer: str
    solution: str | None
    data_source: str
    extra_info: dict
    columns: dict
    where: str  # "FILE row N", for messages


def check_row(row: dict, where: str, task: DatasetTask, answer_field: str) -> Row:
    """A Row from a raw row; DataError naming where and the field if it is unusable."""
    # A file's rows share one schema: a field a row lacks reads as null.
    cols = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"

    def get(name: str, required: bool = True):
        try:
            value = field(row, name)
        except KeyError:
            value = None
        if value is None and required:
            raise DataError(f"{where}: field {name!r} is missing or null (columns: {cols})")
        return value

    prompt = get(task.prompt_field)
    if isinstance(prompt, list):
        ok = prompt and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
        if not ok:
            raise DataError(
                f"{where}: field {task.prompt_field!r} is a list but not of chat messages "
                f"{{'role': str, 'content': str}}: {str(prompt)[:200]}"
            )
        prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DataError(
            f"{where}: field {task.prompt_field!r} must be a non-empty string or a list of "
            f"chat messages, got {prompt!r:.200}"
        )
    answer = get(answer_field)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(
            f"{where}: field {answer_field!r} must be a string or a number, got {answer!r:.200}"
        )
    solution = None
    if task.solution_field:
        solution = get(task.solution_field)
        if not isinstance(solution, str) or not solution.strip():
            raise DataError(
                f"{where}: field {task.solution_field!r} must be a non-empty string, "
                f"got {solution!r:.200}"
            )
    source = get(task.data_source_field, required=False)
    extra = get("extra_info", required=False)
    return Row(
        prompt=prompt,
        answer=str(answer),
        solution=solution,
        data_source="" if source is None else str(source),
        extra_info=extra if isinstance(extra, dict) else {},
        columns=row,
        where=where,
    )


@register_task
@dataclasses.dataclass(frozen=True)
class DatasetTask:
    """Prompts and answers from JSONL / Parquet files, scored by rl.rewards."""

    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    prompt_field: str = "prompt"
    answer_field: str = ""  # "" = the first of ANSWER_FIELDS the first row has
    solution_field: str = ""  # the warm start's demonstrations; "" = none
    data_source_field: str = "data_source"
    rewards: tuple = ("math",)
    reward_timeout_s: float = 10.0
    reward_workers: int = 1
    imports: tuple[str, ...] = ()  # modules that register rewards (set from the run's imports)
    seed: int = 0
    eval_fraction: float = 0.05  # held out by prompt hash when there are no eval_files

    name: ClassVar[str] = "dataset"
    max_turns: ClassVar[int] = 1
    stop_texts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for name in ("train_files", "eval_files", "rewards", "imports"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            as_tuple(self, name)
        if not self.train_files:
            raise DataError("dataset: train_files is empty; give one or more JSONL/Parquet files")
        if not 0.0 < self.eval_fraction < 1.0:
            raise DataError(f"dataset: eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not self.reward_timeout_s > 0:
            raise DataError(f"dataset: reward_timeout_s must be > 0, got {self.reward_timeout_s!r}")
        train, held = self._load(self.train_files), self._load(self.eval_files)
        if not self.eval_files:
            key = lambda r: unit_hash(normalise(r.prompt)) < self.eval_fraction  # noqa: E731
            train, held = [r for r in train if not key(r)], [r for r in train if key(r)]
        else:
            held_keys = {normalise(r.prompt) for r in held}
            kept = [r for r in train if normalise(r.prompt) not in held_keys]
            if len(kept) < len(train):
                print(
                    f"dataset: {len(train) - len(kept)} training rows have a held-out prompt "
                    "and are not trained on",
                    file=sys.stderr,
                )
            train = kept
        if not train or not held:
            raise DataError(
                f"dataset: {len(train)} training and {len(held)} held-out rows; both must be "
                "non-empty (more rows, another eval_fraction, or eval_files)"
            )
        from rl.rewards import make_scorer

        scorer = make_scorer(
            list(self.rewards),
            timeout_s=self.reward_timeout_s,
            workers=self.reward_workers,
            imports=self.imports,
            where="task.options.rewards",
        )
        object.__setattr__(self, "_rows", {"train": train, "eval": held})
        object.__setattr__(self, "_order", [])
        object.__setattr__(self, "_scorer", scorer)

    def _load(self, files: tuple[str, ...]) -> list[Row]:
        rows: list[Row] = []
        answer_field = self.answer_field
        for path in files:
            raw = read_rows(path)
            if not answer_field and raw:
                answer_field = next((f for f in ANSWER_FIELDS if _has(raw[0], f)), ANSWER_FIELDS[0])
            rows += [check_row(r, f"{path} row {i}", self, answer_field) for i, r in enumerate(raw)]
        return rows

    def size(self, split: str) -> int:
        """Rows in split ('train' | 'eval')."""
        return len(self._rows[split])

    def problems(self, split: str, n: int) -> list[Problem]:
        """n problems of split: eval rows in file order (all of them if fewer); train rows in
        seeded epochs, each a new permutation (the list for n is a prefix of larger ones)."""
        rows = self._rows[split]
        if split == "eval":
            return [self._problem("eval", i) for i in range(min(n, len(rows)))]
        while len(self._order) < n:  # one more epoch
            epoch = list(range(len(rows)))
            random.Random(f"dataset:{self.seed}:{len(self._order) // len(rows)}").shuffle(epoch)
            self._order.extend(epoch)
        return [self._problem("train", i) for i in self._order[:n]]

    def _problem(self, split: str, i: int) -> Problem:
        r = self._rows[split][i]
        text = r.prompt if isinstance(r.prompt, str) else r.prompt[-1]["content"]
        meta = {"row": r.where}
        if not isinstance(r.prompt, str):
            meta["messages"] = r.prompt
        return Problem(id=f"{split}-{i}", prompt=text, answer=r.answer, meta=meta)

    def row(self, problem: Problem) -> Row:
        """The data row behind a problem."""
        split, _, i = problem.id.rpartition("-")
        return self._rows[split][int(i)]

    def split_key(self, problem: Problem) -> str:
        """The normalised prompt: duplicates share a split."""
        return normalise(self.row(problem).prompt)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """The configured rewards' weighted sum (a failing reward scores 0 and is counted)."""
        from rl.rewards import Sample

        r = self.row(problem)
        sample = Sample(
            prompt=r.prompt if isinstance(r.prompt, str) else problem.prompt,
            messages=r.prompt if isinstance(r.prompt, tuple) else None,
            answer=r.answer,
            data_source=r.data_source,
            extra_info=r.extra_info,
            columns=r.columns,
        )
        return self._scorer.score(completion, sample)

    def demonstration(self, problem: Problem) -> str:
        """The row's solution (solution_field)."""
        r = self.row(problem)
        if r.solution is None:
            raise DataError(
                "dataset: a warm start needs demonstrations: set task.options.solution_field "
                "to the column holding worked solutions, or sft.steps: 0"
            )
        return r.solution

    def env_step(self, problem: Problem, transcript: str) -> str | None:
        """Single turn."""
        return None

    def stats(self) -> dict:
        """Reward failures so far (reward/errors, reward/timeouts, reward/calls)."""
        return self._scorer.stats()

    def close(self) -> None:
        """Stops the reward workers."""
        self._scorer.close()


def _has(row: dict, name: str) -> bool:
    try:
        field(row, name)
        return True
    except KeyError:
        return False
