"""Runs episodes against an engine, token-exact and multi-turn.

The tokens trained are exactly the tokens sampled: a turn's prompt is the episode's token ids so
far (never decoded and re-encoded), environment observations are appended as tokens with loss
mask 0, and every generated token keeps its behavior log-prob and the version that made it.
A generation interrupted by a weight update (finish_reason "abort", the `continue` mode of
partial rollouts) is resubmitted with its prefix as the prompt: the engine rebuilds the KV cache
with the new weights and later tokens carry the new version.

A preemption stops the loop instead (`halt`): the engine aborts, and every group still running
comes back as a PartialGroup (rl.partials) holding each sample's tokens and agent state. Given
back to run_groups at resume, it is continued the same way, whatever the run's partial mode.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from rl.partials import PartialGroup, PartialSample
from rl.rollout.base import Engine, GenerationRequest, SamplingParams, WorkerLost
from rl.tasks.base import Problem
from rl.types import Episode, EpisodeGroup

_ids = itertools.count()


@dataclasses.dataclass
class _Draft:
    """A mutable episode in progress (frozen into an Episode at the end)."""

    problem: Problem
    seed: int
    tokens: list[int]
    mask: list[int]
    logp: list[float]
    versions: list[int]
    prompt_len: int
    turn: int = 0
    turn_budget: int = 0  # tokens left in the current turn
    finish_reason: str = "stop"
    done: bool = False
    aborts: int = 0

    @classmethod
    def of(cls, problem: Problem, s: PartialSample) -> _Draft:
        """The draft of a saved sample (continued after its tokens)."""
        return cls(
            problem,
            s.seed,
            s.tokens.tolist(),
            s.loss_mask.tolist(),
            s.behavior_logp.tolist(),
            s.versions.tolist(),
            s.prompt_len,
            turn=s.turn,
            turn_budget=s.turn_budget,
            finish_reason=s.finish_reason,
            done=s.done,
            aborts=s.aborts,
        )

    def saved(self) -> PartialSample:
        """This draft's state, to be continued by a resumed run."""
        return PartialSample(
            seed=self.seed,
            tokens=np.asarray(self.tokens, np.int32),
            loss_mask=np.asarray(self.mask, np.int8),
            behavior_logp=np.asarray(self.logp, np.float32),
            versions=np.asarray(self.versions, np.int32),
            prompt_len=self.prompt_len,
            turn=self.turn,
            turn_budget=self.turn_budget,
            aborts=self.aborts,
            done=self.done,
            finish_reason=self.finish_reason,
        )


def stop_ids(task, tokenizer) -> tuple[int, ...]:
    """Token ids that end a model turn: the tokenizer's end ids (eos, the chat's end of turn)
    plus the task's stop texts (one token each)."""
    ids = [*tokenizer.end_ids] + [tokenizer.token_id(t) for t in getattr(task, "stop_texts", ())]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _budget(problem: Problem, params: SamplingParams) -> int:
    """A turn's token budget: problem.meta["max_new_tokens"] if set, at most the params'."""
    cap = params.max_new_tokens
    return min(int(problem.meta.get("max_new_tokens", cap)), cap)


def run_episodes(
    engine: Engine,
    task,
    tokenizer,
    problems: list[Problem],
    params: SamplingParams,
    *,
    seeds: list[int] | None = None,
    max_aborts: int = 16,
) -> list[Episode]:
    """One episode per problem (repeat a problem n times for a group), all turns batched.

    Per-problem overrides in problem.meta: "max_new_tokens" (the turn budget, capped by
    params.max_new_tokens, which sizes the learner's rows) and "ignore_eos" (True: no stop
    tokens, the turn runs to its budget; synthetic length workloads).
    """
    drafts = _drafts(task, tokenizer, problems, params, seeds)
    _generate(engine, task, tokenizer, drafts, params, max_aborts=max_aborts)
    return [_episode(task, tokenizer, d) for d in drafts]


def _drafts(task, tokenizer, problems, params, seeds, saved=None) -> list[_Draft]:
    """Fresh drafts of problems, or saved[i]'s state where it is given (a resumed sample)."""
    drafts = []
    for i, p in enumerate(problems):
        if saved is not None and saved[i] is not None:
            drafts.append(_Draft.of(p, saved[i]))
            continue
        ids = tokenizer.encode(p.prompt)
        drafts.append(
            _Draft(
                p,
                seeds[i] if seeds else next(_ids),
                list(ids),
                [0] * len(ids),
                [0.0] * len(ids),
                [-1] * len(ids),
                len(ids),
                turn_budget=_budget(p, params),
            )
        )
    return drafts


def _generate(
    engine: Engine,
    task,
    tokenizer,
    drafts: list[_Draft],
    params: SamplingParams,
    *,
    max_aborts: int = 16,
    halt: Callable[[], bool] | None = None,
) -> bool:
    """Runs drafts until each is done; True if halt() stopped it first (drafts keep their
    state: tokens so far, an aborted turn's tokens included)."""
    stops = stop_ids(task, tokenizer)
    params = dataclasses.replace(params, stop_token_ids=stops)
    max_turns = getattr(task, "max_turns", 1)
    while True:
        active = [d for d in drafts if not d.done]
        if not active:
            return False
        if halt is not None and halt():
            return True
        reqs = [
            GenerationRequest(
                f"{id(d)}-{d.turn}-{d.aborts}",
                np.asarray(d.tokens, np.int32),
                dataclasses.replace(
                    params,
                    max_new_tokens=d.turn_budget,
                    stop_token_ids=() if d.problem.meta.get("ignore_eos") else stops,
                    seed=None
                    if params.temperature == 0
                    else (d.seed * 1000003 + d.turn * 1009 + d.aborts * 7919 + len(d.tokens))
                    % (2**31),
                ),
            )
            for d in active
        ]
        gens = engine.generate(reqs)
        for d, g in zip(active, gens):
            d.tokens += g.token_ids.tolist()
            d.mask += [1] * len(g.token_ids)
            d.logp += g.logprobs.tolist()
            d.versions += g.versions.tolist()
            d.turn_budget -= len(g.token_ids)
            if g.finish_reason == "abort" and d.turn_budget > 0:
                d.aborts += 1
                if d.aborts > max_aborts and not (halt is not None and halt()):
                    d.finish_reason, d.done = "abort", True
                continue  # resubmit the prefix on the new weights
            d.finish_reason = g.finish_reason
            d.turn += 1
            ended = len(g.token_ids) and int(g.token_ids[-1]) in tokenizer.end_ids
            if ended or d.turn >= max_turns or g.finish_reason == "length":
                d.done = True
                continue
            transcript = tokenizer.decode(d.tokens[d.prompt_len :])
            obs = task.env_step(d.problem, transcript)
            if obs is None:
                d.done = True
                continue
            obs_ids = tokenizer.encode(obs)
            d.tokens += obs_ids
            d.mask += [0] * len(obs_ids)
            d.logp += [0.0] * len(obs_ids)
            d.versions += [-1] * len(obs_ids)
            d.turn_budget = _budget(d.problem, params)


def _episode(task, tokenizer, d: _Draft) -> Episode:
    """The finished draft as an Episode, with its reward (scored on the text without the end
    token that closed it, as TRL and verl score decoded completions)."""
    generated = d.tokens[d.prompt_len :]
    text = tokenizer.decode(generated)
    if generated and generated[-1] in tokenizer.end_ids:
        generated = generated[:-1]
    r = task.reward(d.problem, tokenizer.decode(generated))
    return Episode(
        problem_id=d.problem.id,
        tokens=np.asarray(d.tokens, np.int32),
        loss_mask=np.asarray(d.mask, np.int8),
        behavior_logp=np.asarray(d.logp, np.float32),
        versions=np.asarray(d.versions, np.int32),
        prompt_len=d.prompt_len,
        reward=float(r.reward),
        correct=bool(r.correct),
        formatted=bool(r.formatted),
        finish_reason=d.finish_reason,
        num_turns=d.turn,
        completion_text=text,
    )


def run_groups(
    engine: Engine,
    task,
    tokenizer,
    items,
    params: SamplingParams,
    *,
    halt: Callable[[], bool] | None = None,
) -> list[EpisodeGroup | PartialGroup]:
    """Runs admitted groups [(group id, dispatch version, problem, seeds[, saved])] as
    EpisodeGroups. `saved`, a PartialGroup of a preemption, is continued after its tokens (it
    keeps its first dispatch version). Once halt() is true (a preemption: the engine was
    aborted) each group not yet finished comes back as a PartialGroup instead."""
    problems, seeds, saved = [], [], []
    for g, _, p, s, *rest in items:
        part = rest[0] if rest else None
        if part is not None and (part.group_id, part.problem_id, len(part.samples)) != (
            g,
            p.id,
            len(s),
        ):
            raise ValueError(
                f"group {g}: saved partial of group {part.group_id} (problem "
                f"{part.problem_id!r}, {len(part.samples)} samples), want problem {p.id!r} "
                f"with {len(s)} samples"
            )
        problems += [p] * len(s)
        seeds += list(s)
        saved += list(part.samples) if part is not None else [None] * len(s)
    drafts = _drafts(task, tokenizer, problems, params, seeds, saved)
    try:
        halted = _generate(engine, task, tokenizer, drafts, params, halt=halt)
    except WorkerLost as e:  # the groups start again from their prompts: count what is lost
        e.tokens_generated = sum(sum(d.mask) for d in drafts)
        raise
    groups, k = [], 0
    for g, v, p, s, *rest in items:
        mine = drafts[k : k + len(s)]
        k += len(s)
        version = rest[0].dispatch_version if rest and rest[0] is not None else v
        if halted and not all(d.done for d in mine):
            groups.append(PartialGroup(g, p.id, version, tuple(d.saved() for d in mine)))
        else:
            groups.append(
                EpisodeGroup(g, p.id, tuple(_episode(task, tokenizer, d) for d in mine), version)
            )
    return groups
