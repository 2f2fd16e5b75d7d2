"""rl.rewards: the built-ins against hand-computed cases (Math-Verify for math), weighted sums,
TRL / verl / plain user functions, start-up errors, and faults (errors, timeouts, crashes)."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rl.config_rules import ConfigError
from rl.rewards import (
    REWARDS,
    RewardSpecError,
    Sample,
    exact_reward,
    final_answer,
    format_reward,
    make_scorer,
    math_reward,
    numeric_reward,
    reward_names,
)
from rl.tasks.base import MAX_COMPLETION_CHARS, RewardResult

USER_MODULE = '''
import os
import time

from rl.rewards import register_reward

CALLS = []


def trl_reward(completions, prompts=None, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [0.25]


def trl_strict(prompts, completions, answer):
    return [1.0 if answer == ["42"] and prompts == ["What is 6*7?"] else 0.5]


def trl_none(completions, **kwargs):
    return [None]


def trl_scalar(completions, **kwargs):
    return 1.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(
        {"data_source": data_source, "solution_str": solution_str,
         "ground_truth": ground_truth, "extra_info": extra_info}
    )
    return {"score": 0.75, "acc": True}


def verl_float(solution_str, ground_truth, bonus=0.0):
    return (1.0 if ground_truth in solution_str else 0.0) + bonus


def verl_no_score(data_source, solution_str, ground_truth):
    return {"acc": 1.0}


def length(completion, answer, scale=1.0):
    return scale * len(completion)


def needs_more(completion, answer, level):
    return 0.0


def wrong(text, gold):
    return 0.0


def boom(completion, answer):
    raise RuntimeError("boom from a user reward")


def nan(completion, answer):
    return float("nan")


def word(completion, answer):
    return "1"


def moody(completion, answer):
    """Faults on demand, else 1.0 if the answer is in the completion."""
    if completion.startswith("raise"):
        raise RuntimeError("moody raised")
    if completion.startswith("nan"):
        return float("nan")
    if completion.startswith("sleep"):
        time.sleep(30)
    if completion.startswith("crash"):
        os._exit(3)
    if completion.startswith("nap"):  # "nap PATH": touch PATH, then sleep 1 s
        open(completion.split()[1], "w").close()
        time.sleep(1.0)
    return 1.0 if answer in completion else 0.0


@register_reward("user_len")
def user_len(completion, answer):
    return float(len(completion))
'''

CONFLICT_MODULE = """
from rl.rewards import register_reward


@register_reward("exact")
def exact(completion, answer):
    return 1.0
"""

SAMPLE = Sample(prompt="What is 6*7?", messages=None, answer="42")


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user reward module, importable as `user_rewards` (here and in spawned workers)."""
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / "user_rewards.py").write_text(USER_MODULE)
    (folder / "user_conflict.py").write_text(CONFLICT_MODULE)
    sys.path.insert(0, str(folder))
    import user_rewards

    yield user_rewards
    sys.path.remove(str(folder))
    sys.modules.pop("user_rewards", None)
    REWARDS.pop("user_len", None)


def test_final_answer():
    assert final_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert final_answer("\\boxed{1} then \\boxed{ 2 }") == "2"
    assert final_answer("\\boxed{7} and an open \\boxed{8") == "7"
    assert final_answer("\\boxed{{a}{b}}") == "{a}{b}"
    assert final_answer("#### 1 \n#### 42 apples\nmore") == "42 apples"
    assert final_answer("#### 3 and \\boxed{4}") == "4"
    assert final_answer("<answer> 7 </answer><|im_end|>") == "7"
    assert final_answer("<answer>7</answer> trailing") is None
    assert final_answer("the answer is 42") is None
    assert final_answer("\\boxed{}") is None
    assert final_answer("\\boxed{1}" + " " * MAX_COMPLETION_CHARS) is None


def test_exact():
    assert exact_reward("#### 42", " 42 ") == 1.0
    assert exact_reward("\\boxed{x +\n 1}", "x + 1") == 1.0
    assert exact_reward("#### 41", "42") == 0.0
    assert exact_reward("#### 1,234", "1234") == 0.0
    assert exact_reward("42", "42") == 0.0  # no final answer


def test_numeric():
    assert numeric_reward("#### $1,234.", "1234") == 1.0
    assert numeric_reward("\\boxed{12\\%}", "12") == 1.0
    assert numeric_reward("#### 0.1", "0.1000000001") == 1.0  # relative 1e-9 < 1e-6
    assert numeric_reward("#### 1.00001", "1") == 0.0  # relative 1e-5
    assert numeric_reward("#### 0", "1e-10") == 1.0  # absolute 1e-10 < 1e-9
    assert numeric_reward("#### 0", "1e-8") == 0.0
    assert numeric_reward("#### -3.5", "-3.50") == 1.0
    assert numeric_reward("#### abc", "1") == 0.0
    assert numeric_reward("#### nan", "nan") == 0.0
    assert numeric_reward("no answer 42", "42") == 0.0


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("#### 42", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{84}{2}}", "42", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("so \\boxed{x^2 + 1}.", "1 + x^2", 1.0),
        ("The answer is 42.", "42", 1.0),  # Math-Verify's own extraction
        ("#### 41", "42", 0.0),
        ("\\boxed{3}", "\\sqrt{8}", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("no number here", "42", 0.0),
        ("\\boxed{42}", "", 0.0),
    ],
)
def test_math(completion, answer, want):
    assert math_reward(completion, answer) == want


def test_format():
    assert format_reward("#### 4", "") == 1.0
    assert format_reward("<answer>4</answer>", "") == 1.0
    assert format_reward("four", "") == 0.0
    assert format_reward("<think>a\nb</think> 4", "", pattern=r"^<think>.*</think>") == 1.0
    assert format_reward("4 <think>a</think>", "", pattern=r"^<think>.*</think>") == 0.0


def test_weighted_sum_correct_and_formatted():
    assert {"exact", "numeric", "math", "format"} <= set(reward_names())
    scorer = make_scorer(["math", {"name": "format", "weight": 0.5}], workers=0)
    assert scorer.score("#### 42", SAMPLE) == RewardResult(1.5, True, True)
    assert scorer.score("#### 41", SAMPLE) == RewardResult(0.5, False, True)
    assert scorer.score("it is 41", SAMPLE) == RewardResult(0.0, False, False)
    # correct is the first listed reward's own value: here format, not math.
    scorer = make_scorer([{"name": "format", "weight": 2.0}, "math"], workers=0)
    assert scorer.score("#### 41", SAMPLE) == RewardResult(2.0, True, True)
    # formatted also holds when correct without a final answer.
    scorer = make_scorer([{"name": "format", "args": {"pattern": "sure"}}], workers=0)
    assert scorer.score("I am sure", SAMPLE) == RewardResult(1.0, True, True)
    scorer = make_scorer([{"name": "numeric", "weight": -1}], workers=0)
    assert scorer.score("#### 42", SAMPLE) == RewardResult(-1.0, True, True)
    assert scorer.stats() == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/calls": 1.0}
    scorer.close()


def test_trl_functions(user):
    columns = {"prompt": "What is 6*7?", "answer": "42", "level": 3}
    text = Sample(prompt="What is 6*7?", messages=None, answer="42", columns=columns)
    messages = ({"role": "user", "content": "What is 6*7?"},)
    chat = Sample(prompt="rendered", messages=messages, answer="42", columns=columns)
    scorer = make_scorer(
        [
            {"function": "user_rewards:trl_reward", "args": {"flag": True}},
            {"function": "user_rewards:trl_strict", "weight": 2.0},
            {"function": "user_rewards:trl_none"},
        ],
        workers=0,
    )
    user.CALLS.clear()
    assert scorer.score("#### 42", text) == RewardResult(2.25, False, True)
    assert scorer.score("#### 42", chat) == RewardResult(1.25, False, True)
    assert user.CALLS == [
        {
            "prompts": ["What is 6*7?"],
            "completions": ["#### 42"],
            "completion_ids": None,
            "answer": ["42"],
            "level": [3],
            "flag": True,
        },
        {
            "prompts": [[{"role": "user", "content": "What is 6*7?"}]],
            "completions": [[{"role": "assistant", "content": "#### 42"}]],
            "completion_ids": None,
            "answer": ["42"],
            "level": [3],
            "flag": True,
        },
    ]
    assert scorer.stats()["reward/errors"] == 0.0


def test_verl_and_plain_functions(user):
    sample = Sample(
        prompt="p", messages=None, answer="42", data_source="gsm8k", extra_info={"split": "train"}
    )
    scorer = make_scorer(
        [
            {"function": "user_rewards:compute_score"},
            {"function": "user_rewards:verl_float", "args": {"bonus": 0.5}},
            {"function": "user_rewards:length", "weight": 0.5, "args": {"scale": 2.0}},
            {"name": "user_len", "weight": 0.25},
        ],
        imports=("user_rewards",),
        workers=0,
    )
    user.CALLS.clear()
    # 0.75 + (1 + 0.5) + 0.5 * 2 * 7 + 0.25 * 7
    assert scorer.score("#### 42", sample) == RewardResult(11.0, False, True)
    assert user.CALLS == [
        {
            "data_source": "gsm8k",
            "solution_str": "#### 42",
            "ground_truth": "42",
            "extra_info": {"split": "train"},
        }
    ]


def test_faults_in_thread_are_counted_and_printed_once(user, capsys):
    specs = [
        {"function": "user_rewards:boom"},
        {"function": "user_rewards:nan", "weight": 3.0},
        {"function": "user_rewards:word"},
        {"function": "user_rewards:trl_scalar"},
        {"function": "user_rewards:verl_no_score"},
        {"name": "format", "weight": 0.5},
    ]
    scorer = make_scorer(specs, workers=0)
    assert scorer.score("#### 42", SAMPLE) == RewardResult(0.5, False, True)
    assert scorer.score("#### 42", SAMPLE) == RewardResult(0.5, False, True)
    assert scorer.stats() == {"reward/errors": 10.0, "reward/timeouts": 0.0, "reward/calls": 2.0}
    err = capsys.readouterr().err
    assert err.count("scored 0") == 1
    assert "'user_rewards:boom'" in err and "RuntimeError: boom from a user reward" in err


def _error(specs, **kw) -> str:
    with pytest.raises(RewardSpecError) as info:
        make_scorer(specs, workers=0, where="task.options.rewards", **kw)
    assert isinstance(info.value, ConfigError)
    return str(info.value)


def test_startup_errors(user):
    msg = _error(["math", "nope"])
    assert "task.options.rewards[1].name: unknown reward 'nope'" in msg
    assert "exact, format, math, numeric" in msg
    msg = _error([{"function": "no_such_module_xyz:f"}])
    assert "task.options.rewards[0].function: cannot import module 'no_such_module_xyz'" in msg
    msg = _error([{"function": "user_rewards:nothing"}])
    assert "has no attribute 'nothing'" in msg and "moody" in msg
    msg = _error([{"function": "user_rewards"}])
    assert "expected 'package.module:function'" in msg
    msg = _error([{"function": "user_rewards:wrong"}])
    assert "(text, gold) is none of the accepted ones" in msg
    assert "completions" in msg and "solution_str, ground_truth" in msg
    assert "completion, answer" in msg
    msg = _error([{"name": "format", "args": {"pattern": "(unclosed"}}])
    assert "task.options.rewards[0].args" in msg and "'(unclosed' is not a valid regular" in msg
    msg = _error([{"name": "exact", "args": {"scale": 1}}])
    assert "takes no argument 'scale'" in msg
    msg = _error([{"function": "user_rewards:length", "args": {"answer": "x"}}])
    assert "takes no argument 'answer'; valid: scale" in msg
    msg = _error([{"function": "user_rewards:needs_more"}])
    assert "needs argument(s) ['level']" in msg
    assert "weight: invalid value 'x'" in _error([{"name": "math", "weight": "x"}])
    assert "unknown key(s) ['wieght']" in _error([{"name": "math", "wieght": 1}])
    assert "exactly one of name" in _error([{"name": "math", "function": "a:b"}])
    assert "non-empty list" in _error([])
    assert "cannot import module 'no_such_module_xyz'" in _error(
        ["math"], imports=("no_such_module_xyz",)
    )
    msg = _error(["math"], imports=("user_conflict",))
    assert "'exact' is already registered to rl.rewards.builtin:exact_reward" in msg
    assert "user_conflict:exact" in msg
    assert REWARDS["exact"].fn is exact_reward


def test_worker_pool_faults_timeout_and_threads(user, capsys):
    """One worker: errors, a timeout (the worker is replaced), a crash, then shared by threads."""
    specs = [
        {"function": "user_rewards:moody"},
        {"name": "math", "weight": 0.5},
        {"name": "user_len", "weight": 0.25},
    ]
    scorer = make_scorer(specs, timeout_s=0.5, workers=1, imports=("user_rewards",))
    try:
        assert scorer.score("#### 42", SAMPLE) == RewardResult(3.25, True, True)  # 1+.5+.25*7
        assert scorer.score("raise #### 42", SAMPLE) == RewardResult(3.75, False, True)
        assert scorer.score("nan #### 42", SAMPLE) == RewardResult(3.25, False, True)
        start = time.monotonic()
        assert scorer.score("sleep #### 42", SAMPLE) == RewardResult(0.0, False, True)
        assert time.monotonic() - start < 5.0
        assert scorer.score("#### 42", SAMPLE) == RewardResult(3.25, True, True)  # a new worker
        assert scorer.score("crash #### 42", SAMPLE) == RewardResult(0.0, False, True)
        assert scorer.score("#### 42", SAMPLE) == RewardResult(3.25, True, True)
        stats = {"reward/errors": 3.0, "reward/timeouts": 1.0, "reward/calls": 7.0}
        assert scorer.stats() == stats
        err = capsys.readouterr().err
        assert err.count("scored 0") == 2  # the first error and the first timeout
        assert "'user_rewards:moody'" in err and "RuntimeError: moody raised" in err
        assert "ran past timeout_s=0.5 s" in err

        results = []

        def caller():
            results.extend(scorer.score("#### 42", SAMPLE) for _ in range(10))

        threads = [threading.Thread(target=caller) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [RewardResult(3.25, True, True)] * 40
    finally:
        scorer.close()
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score("#### 42", SAMPLE)


def test_waiting_for_a_free_worker_has_a_deadline(user, tmp_path, capsys):
    scorer = make_scorer([{"function": "user_rewards:moody"}], timeout_s=5.0, workers=1, wait_s=0.2)
    try:
        started = tmp_path / "napping"
        napper = threading.Thread(target=scorer.score, args=(f"nap {started}", SAMPLE))
        napper.start()
        deadline = time.monotonic() + 30.0
        while not started.exists():  # then the napper holds the only worker for 1 s
            assert time.monotonic() < deadline, "the nap never started"
            time.sleep(0.01)
        assert scorer.score("#### 42", SAMPLE) == RewardResult(0.0, False, True)
        napper.join()
        assert scorer.score("#### 42", SAMPLE) == RewardResult(1.0, True, True)
        stats = {"reward/errors": 0.0, "reward/timeouts": 1.0, "reward/calls": 3.0}
        assert scorer.stats() == stats
        assert "no reward worker was free within wait_s=0.2 s" in capsys.readouterr().err
    finally:
        scorer.close()


def test_worker_start_error_names_the_spec():
    specs = ["math", {"name": "format", "args": {"pattern": "(unclosed"}}]
    match = r"rewards\[1\]\.args.*'\(unclosed' is not a valid.*\(in a reward worker process\)"
    with pytest.raises(RewardSpecError, match=match):
        make_scorer(specs, workers=1)


def test_exit_without_close_is_clean():
    code = textwrap.dedent(
        """
        from rl.rewards import Sample, make_scorer
        if __name__ == "__main__":
            scorer = make_scorer(["exact"], workers=2)
            print(scorer.score("#### 1", Sample(prompt="", messages=None, answer="1")).reward)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "1.0\n"
    assert done.stderr == ""
