"""Runs episodes against an engine, token-exact and multi-turn.

The tokens trained are exactly the tokens sampled: a turn's prompt is the episode's token ids so
far (never decoded and re-encoded), environment observations are appended as tokens with loss
mask 0, and every generated token keeps its behavior log-prob and the version that made it.
A generation interrupted by a weight update (finish_reason "abort", the `continue` mode of
partial rollouts) is resubmitted with its prefix as the prompt: the engine rebuilds the KV cache
with the new weights and later tokens carry the new version.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from rl.rollout.base import Engine, GenerationRequest, SamplingParams
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


def stop_ids(task, tokenizer) -> tuple[int, ...]:
    """Token ids that end a model turn: eos plus the task's stop texts (one token each)."""
    ids = [tokenizer.eos_id] + [tokenizer.token_id(t) for t in getattr(task, "stop_texts", ())]
    return tuple(int(i) for i in ids if i is not None)


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
    stops = stop_ids(task, tokenizer)
    params = dataclasses.replace(params, stop_token_ids=stops)
    drafts = []
    for i, p in enumerate(problems):
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
    max_turns = getattr(task, "max_turns", 1)
    while True:
        active = [d for d in drafts if not d.done]
        if not active:
            break
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
                if d.aborts > max_aborts:
                    d.finish_reason, d.done = "abort", True
                continue  # resubmit the prefix on the new weights
            d.finish_reason = g.finish_reason
            d.turn += 1
            ended_by_eos = len(g.token_ids) and int(g.token_ids[-1]) == tokenizer.eos_id
            if ended_by_eos or d.turn >= max_turns or g.finish_reason == "length":
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
    episodes = []
    for d in drafts:
        text = tokenizer.decode(d.tokens[d.prompt_len :])
        r = task.reward(d.problem, text)
        episodes.append(
            Episode(
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
        )
    return episodes


def run_groups(
    engine: Engine, task, tokenizer, items, params: SamplingParams
) -> list[EpisodeGroup]:
    """Runs admitted groups [(group id, dispatch version, problem, seeds)] as EpisodeGroups."""
    problems, seeds = [], []
    for _, _, p, s in items:
        problems += [p] * len(s)
        seeds += list(s)
    eps = run_episodes(engine, task, tokenizer, problems, params, seeds=seeds)
    groups, k = [], 0
    for g, v, p, s in items:
        groups.append(EpisodeGroup(g, p.id, tuple(eps[k : k + len(s)]), v))
        k += len(s)
    return groups
