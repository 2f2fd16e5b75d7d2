"""Rewards for data-file tasks: functions chosen by name or import path in the config, summed
with weights, run in worker processes that enforce a time limit.

A reward function has one of three signatures, told apart by its parameter names:
  TRL:   f(completions, prompts=..., **kwargs) -> list[float]
         called for one completion as TRL's GRPOTrainer does: prompts=[prompt],
         completions=[completion], completion_ids=None, and every data column except prompt as
         a one-item list; a chat row gets prompts=[messages] and
         completions=[[{"role": "assistant", "content": completion}]]. A None score is 0.0.
  verl:  compute_score(data_source, solution_str, ground_truth, extra_info=None)
         -> float, or a dict with a "score" key.
  plain: f(completion, answer, **args) -> float   (the built-ins' form)
Each also receives the spec's `args` as keyword arguments, and (TRL, verl) only the keywords
it accepts unless it takes **kwargs.

Built-ins (rl/rewards/builtin.py): exact, numeric, math (HF Math-Verify), format. A user's
module adds its own with `@register_reward("name")` and is listed in the run's imports.
"""

from rl.rewards.builtin import (
    exact_reward,
    final_answer,
    format_reward,
    math_reward,
    numeric_reward,
    parse_number,
)
from rl.rewards.registry import (
    FORMS,
    REWARDS,
    BoundReward,
    RegisteredReward,
    RewardSpecError,
    Sample,
    call_reward,
    register_reward,
    resolve_specs,
    reward_names,
)
from rl.rewards.scorer import Scorer, make_scorer

__all__ = [
    "FORMS",
    "REWARDS",
    "BoundReward",
    "RegisteredReward",
    "RewardSpecError",
    "Sample",
    "Scorer",
    "call_reward",
    "exact_reward",
    "final_answer",
    "format_reward",
    "make_scorer",
    "math_reward",
    "numeric_reward",
    "parse_number",
    "register_reward",
    "resolve_specs",
    "reward_names",
]
