"""Reward functions by name, the sample they score, and the three signatures they may have."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
import traceback
from collections.abc import Callable, Sequence

from rl.config_rules import ConfigError

FORMS = {
    "trl": "TRL: f(completions, prompts=..., **kwargs) -> list[float]",
    "verl": "verl: compute_score(data_source, solution_str, ground_truth, extra_info=None)",
    "plain": "plain: f(completion, answer, **args) -> float",
}
# The keyword arguments each form receives from the scorer; `args` may not rebind them.
FIXED_ARGS = {
    "trl": ("prompts", "completions", "completion_ids"),
    "verl": ("data_source", "solution_str", "ground_truth", "extra_info"),
    "plain": ("completion", "answer"),
}
# Columns TRL keeps out of a reward function's keyword arguments.
TRL_SKIPPED_COLUMNS = ("prompt", "completion", "completion_ids")
SPEC_KEYS = ("name", "function", "weight", "args")


class RewardSpecError(ConfigError):
    """A reward spec names an unknown reward, an unloadable function or invalid arguments."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """What a reward function may read about one completion's data row."""

    prompt: str  # the prompt text as rendered
    messages: tuple | None  # ({"role", "content"}, ...) for a chat row, None for a text prompt
    answer: str  # the ground truth
    data_source: str = ""
    extra_info: dict = dataclasses.field(default_factory=dict)
    columns: dict = dataclasses.field(default_factory=dict)  # every column of the row, as loaded


@dataclasses.dataclass(frozen=True)
class RegisteredReward:
    """A reward function under a name, and its start-up hook.

    `prepare(args)` runs once in every process that will call the reward, with the spec's
    bound args; it raises ValueError for invalid args and may warm caches.
    """

    name: str
    fn: Callable
    prepare: Callable[[dict], None] | None = None


REWARDS: dict[str, RegisteredReward] = {}


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def register_reward(name: str, prepare: Callable[[dict], None] | None = None) -> Callable:
    """Decorator registering a reward function (any of the three forms) under `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward name must be a non-empty str, got {name!r}")

    def wrap(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: expected a callable, got {fn!r}")
        old = REWARDS.get(name)
        if old is not None and old.fn is not fn and _qualified(old.fn) != _qualified(fn):
            raise ValueError(
                f"reward name {name!r} is already registered to {_qualified(old.fn)}; cannot "
                f"register {_qualified(fn)} under it (choose another name)"
            )
        REWARDS[name] = RegisteredReward(name, fn, prepare)  # a re-imported module replaces
        return fn

    return wrap


def reward_names() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(REWARDS)


def reward_form(fn: Callable) -> str:
    """'trl', 'verl' or 'plain' by fn's parameter names; ValueError naming the valid forms."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise ValueError(f"its signature cannot be read ({e})") from None
    if "completions" in params:
        return "trl"
    if "solution_str" in params and "ground_truth" in params:
        return "verl"
    if "completion" in params and "answer" in params:
        return "plain"
    raise ValueError(
        f"its signature {inspect.signature(fn)} is none of the accepted ones; valid: "
        + "; ".join(FORMS.values())
    )


@dataclasses.dataclass(frozen=True)
class BoundReward:
    """One resolved spec item: the function, its form, weight and bound keyword arguments."""

    label: str  # the registered name or 'package.module:function'
    fn: Callable
    form: str  # a key of FORMS
    weight: float
    args: dict
    params: frozenset  # the parameter names fn accepts by keyword
    any_kwargs: bool  # fn takes **kwargs


def import_modules(imports: Sequence[str], where: str) -> None:
    """Imports the modules that register rewards; RewardSpecError naming one that fails."""
    for module in imports:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise RewardSpecError(
                f"{where}: cannot import module {module!r} (from imports): {type(e).__name__}: {e}"
            ) from e


def load_function(path: str, where: str) -> Callable:
    """The callable at 'package.module:function'; RewardSpecError saying why it can't load."""
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not attr or ":" in attr:
        raise RewardSpecError(
            f"{where}.function: invalid value {path!r}; expected 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardSpecError(
            f"{where}.function: cannot import module {module_name!r} for {path!r}: "
            f"{type(e).__name__}: {e}"
        ) from e
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            found = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            )
            raise RewardSpecError(
                f"{where}.function: module {module_name!r} has no attribute {attr!r} "
                f"(for {path!r}); its public callables: {', '.join(found) or 'none'}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise RewardSpecError(f"{where}.function: {path!r} is {target!r}, not a function")
    return target


def _check_args(label: str, fn: Callable, form: str, args: dict, where: str) -> None:
    params = inspect.signature(fn).parameters
    kinds = inspect.Parameter
    any_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    by_keyword = [
        n for n, p in params.items() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    ]
    for key in args:
        if key in FIXED_ARGS[form] or (not any_kwargs and key not in by_keyword):
            valid = [n for n in by_keyword if n not in FIXED_ARGS[form]]
            raise RewardSpecError(
                f"{where}.args: {label!r} takes no argument {key!r}; valid: "
                f"{', '.join(valid) or 'none'}{' (or any, it has **kwargs)' if any_kwargs else ''}"
            )
    if form == "trl":  # data columns arrive at call time; they are not known here
        return
    supplied = set(FIXED_ARGS[form]) | set(args)
    missing = [
        n
        for n, p in params.items()
        if p.default is kinds.empty
        and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        and n not in supplied
    ]
    if missing:
        raise RewardSpecError(
            f"{where}: {label!r} needs argument(s) {missing} that nothing supplies; set them "
            f"in args, or give them defaults ({FORMS[form]})"
        )


def _as_weight(value, where: str) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)):
        raise RewardSpecError(f"{where}.weight: invalid value {value!r}; expected a finite number")
    return float(value)


def resolve_spec(item, where: str, prepare: bool = True) -> BoundReward:
    """A BoundReward from one spec item: a name, or {name | function, weight, args}."""
    if isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, dict):
        raise RewardSpecError(
            f"{where}: invalid value {item!r}; expected a reward name or a mapping with keys "
            f"{', '.join(SPEC_KEYS)}"
        )
    unknown = sorted(set(item) - set(SPEC_KEYS), key=str)
    if unknown:
        raise RewardSpecError(
            f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(SPEC_KEYS)}"
        )
    if ("name" in item) == ("function" in item):
        raise RewardSpecError(
            f"{where}: give exactly one of name (a registered reward) or function "
            f"('package.module:function'), got {item!r}"
        )
    weight = _as_weight(item.get("weight", 1.0), where)
    args = item.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise RewardSpecError(f"{where}.args: invalid value {args!r}; expected a mapping")
    hook = None
    if "name" in item:
        label = item["name"]
        entry = REWARDS.get(label) if isinstance(label, str) else None
        if entry is None:
            raise RewardSpecError(
                f"{where}.name: unknown reward {label!r}; valid names: "
                f"{', '.join(reward_names())} (a name registered by your own module needs that "
                "module in imports), or use function: 'package.module:function'"
            )
        fn, hook = entry.fn, entry.prepare
    else:
        label = item["function"]
        fn = load_function(label, where)
    try:
        form = reward_form(fn)
    except ValueError as e:
        raise RewardSpecError(f"{where}: reward {label!r}: {e}") from None
    _check_args(label, fn, form, args, where)
    if prepare and hook is not None:
        try:
            hook(dict(args))
        except ValueError as e:
            raise RewardSpecError(f"{where}.args: reward {label!r}: {e}") from None
    params = inspect.signature(fn).parameters
    return BoundReward(
        label=label,
        fn=fn,
        form=form,
        weight=weight,
        args=dict(args),
        params=frozenset(params),
        any_kwargs=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()),
    )


def resolve_specs(specs, where: str, prepare: bool = True) -> list[BoundReward]:
    """BoundRewards from a spec list; RewardSpecError naming where[i] for a bad item."""
    if isinstance(specs, (str, dict)) or not isinstance(specs, Sequence) or not specs:
        raise RewardSpecError(
            f"{where}: invalid value {specs!r}; expected a non-empty list of reward names or "
            f"mappings (valid names: {', '.join(reward_names())})"
        )
    return [resolve_spec(item, f"{where}[{i}]", prepare) for i, item in enumerate(specs)]


def _keywords(reward: BoundReward, kwargs: dict) -> dict:
    if reward.any_kwargs:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in reward.params}


def as_score(value) -> float:
    """A finite float from a reward's return value; TypeError / ValueError naming it."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {value!r} ({type(value).__name__}); expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value!r}; expected a finite number")
    return value


def call_reward(reward: BoundReward, completion: str, sample: Sample) -> float:
    """The reward's score of one completion, calling fn in its own form's convention."""
    if reward.form == "plain":
        return as_score(reward.fn(completion=completion, answer=sample.answer, **reward.args))
    if reward.form == "verl":
        kwargs = {
            "data_source": sample.data_source,
            "solution_str": completion,
            "ground_truth": sample.answer,
            "extra_info": sample.extra_info,
            **reward.args,
        }
        value = reward.fn(**_keywords(reward, kwargs))
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"returned a dict without 'score' (keys: {sorted(value)})")
            value = value["score"]
        return as_score(value)
    if sample.messages is None:
        prompts, completions = [sample.prompt], [completion]
    else:
        prompts = [list(sample.messages)]
        completions = [[{"role": "assistant", "content": completion}]]
    columns = {
        k: [v]
        for k, v in sample.columns.items()
        if k not in TRL_SKIPPED_COLUMNS and k not in FIXED_ARGS["trl"]
    }
    kwargs = {
        **columns,
        **reward.args,
        "prompts": prompts,
        "completions": completions,
        "completion_ids": None,
    }
    values = reward.fn(**_keywords(reward, kwargs))
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        raise TypeError(f"returned {values!r}; expected a list of one float (one completion)")
    return 0.0 if values[0] is None else as_score(values[0])  # None: TRL's "not applicable"


def call_safely(reward: BoundReward, completion: str, sample: Sample) -> tuple[float, str]:
    """(score, "") or, when the reward raises or returns no finite number, (0.0, traceback)."""
    try:
        return call_reward(reward, completion, sample), ""
    except Exception:
        return 0.0, traceback.format_exc()
