"""The agent is token-exact: a multi-turn calculator episode against a scripted fake engine."""

import numpy as np
import pytest

from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl.agent import run_episodes, stop_ids
from rl.rollout.base import Generation, SamplingParams
from rl.tasks import CalculatorTask
from rl.tasks.calculator import tool_response

OOV = 120  # an id the tokenizer does not know: decodes to "" (a re-encode would drop it)


class FakeEngine:
    """A FAKE engine: replays scripted (tokens, logprobs, version, finish_reason) per request.

    It only stands in for a real engine's timing and outputs; it records every request.
    """

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}  # episode key -> generations
        self.calls = []
        self.version = 0

    def generate(self, requests):
        self.calls.append(requests)
        out = []
        for r in requests:
            key = self.key_of(r)
            tokens, logps, version, reason = self.script[key].pop(0)
            assert len(tokens) <= r.params.max_new_tokens
            out.append(
                Generation(
                    r.request_id,
                    np.asarray(tokens, np.int32),
                    np.asarray(logps, np.float32),
                    np.full(len(tokens), version, np.int32),
                    reason,
                )
            )
        return out

    key_of = None  # set by the test: request -> episode key


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_task_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _logps(n, start):
    return [-(start + 0.01 * i) for i in range(n)]


def test_multi_turn_episode_is_token_exact(tok):
    task = CalculatorTask(max_turns=3)
    problems = task.problems("train", 3)
    a, b, c = problems
    chars = lambda s: [tok.token_id(ch) for ch in s]  # one token per character, never merged
    expr = a.meta["expression"]
    call_open, call_close = tok.token_id("<tool_call>"), tok.token_id("</tool_call>")
    eos = tok.eos_id

    # Episode A: turn 1 is interrupted (abort) and resumed; turn 2 answers with "<answer>" spelt
    # out character by character (a re-encode would merge it into the single <answer> token).
    a1 = [OOV, call_open] + chars(expr[:3])
    a2 = chars(expr[3:]) + [call_close]
    a3 = chars("<answer>") + chars(a.answer) + [tok.token_id("</answer>"), eos]
    # Episode B: answers in one turn and ends with eos.
    b1 = [tok.token_id("<answer>")] + chars(b.answer) + [tok.token_id("</answer>"), eos]
    # Episode C: runs out of budget in turn 1 (no environment step).
    budget = 24
    c1 = chars("<tool_call>1+") + [OOV] * (budget - 13)
    script = {
        a.id: [(a1, _logps(5, 1.0), 3, "abort"), (a2, _logps(len(a2), 2.0), 4, "stop")]
        + [(a3, _logps(len(a3), 3.0), 5, "stop")],
        b.id: [(b1, _logps(len(b1), 4.0), 3, "stop")],
        c.id: [(c1, _logps(len(c1), 5.0), 3, "length")],
    }
    engine = FakeEngine(script)
    prompts = {p.id: tok.encode(p.prompt) for p in problems}
    by_prompt = {tuple(v): k for k, v in prompts.items()}
    engine.key_of = lambda r: next(
        k for p, k in by_prompt.items() if tuple(r.prompt_ids[: len(p)].tolist()) == p
    )
    params = SamplingParams(max_new_tokens=budget, temperature=1.0)
    eps = run_episodes(engine, task, tok, problems, params, seeds=[7, 8, 9])
    ea, eb, ec = eps

    # the text round trip really is lossy for these tokens
    for gen in (a1, a3):
        assert tok.encode(tok.decode(gen)) != gen

    obs = tok.encode(tool_response(expr))
    pa = prompts[a.id]
    np.testing.assert_array_equal(ea.tokens, pa + a1 + a2 + obs + a3)
    gen_mask = [0] * len(pa) + [1] * (len(a1) + len(a2)) + [0] * len(obs) + [1] * len(a3)
    np.testing.assert_array_equal(ea.loss_mask, gen_mask)
    versions = [-1] * len(pa) + [3] * 5 + [4] * len(a2) + [-1] * len(obs) + [5] * len(a3)
    np.testing.assert_array_equal(ea.versions, versions)
    logp = [0.0] * len(pa) + _logps(5, 1.0) + _logps(len(a2), 2.0) + [0.0] * len(obs)
    logp += _logps(len(a3), 3.0)
    np.testing.assert_array_equal(ea.behavior_logp, np.asarray(logp, np.float32))
    assert ea.prompt_len == len(pa) and ea.num_turns == 2 and ea.finish_reason == "stop"
    assert ea.version_span == (3, 5)
    assert ea.correct and ea.reward == 1.0

    pb = prompts[b.id]
    np.testing.assert_array_equal(eb.tokens, pb + b1)
    np.testing.assert_array_equal(eb.loss_mask, [0] * len(pb) + [1] * len(b1))
    assert eb.num_turns == 1 and eb.correct and eb.version_span == (3, 3)

    pc = prompts[c.id]
    np.testing.assert_array_equal(ec.tokens, pc + c1)
    assert ec.finish_reason == "length" and ec.num_turns == 1 and not ec.correct
    assert ec.reward == 0.0

    # What the engine was asked: every prompt is the episode's exact token ids so far.
    assert [len(call) for call in engine.calls] == [3, 1, 1]
    first, resume, turn2 = engine.calls[0], engine.calls[1][0], engine.calls[2][0]
    for r in first:
        assert r.params.max_new_tokens == budget
        assert r.params.stop_token_ids == stop_ids(task, tok) == (eos, call_close)
    np.testing.assert_array_equal(resume.prompt_ids, pa + a1)  # OOV id kept, not re-encoded
    assert resume.params.max_new_tokens == budget - len(a1)  # the turn's remaining budget
    np.testing.assert_array_equal(turn2.prompt_ids, pa + a1 + a2 + obs)
    assert turn2.params.max_new_tokens == budget
    seeds = [first[0].params.seed, resume.params.seed, turn2.params.seed]
    assert len(set(seeds)) == 3 and None not in seeds  # fresh randomness per request
    assert all(not engine.script[k] for k in engine.script)  # every scripted turn consumed


def test_greedy_resubmissions_carry_no_seed_and_grow_the_prefix(tok):
    task = CalculatorTask(max_turns=2)
    (p,) = task.problems("train", 1)
    script = [([OOV], [-0.5], 0, "abort")] * 3 + [([tok.eos_id], [-0.1], 1, "stop")]
    engine = FakeEngine({p.id: script})
    engine.key_of = lambda r: p.id
    eps = run_episodes(engine, task, tok, [p], SamplingParams(max_new_tokens=8, temperature=0.0))
    (e,) = eps
    assert all(r.params.seed is None for call in engine.calls for r in call)
    # three one-token aborts, each resubmitted with the grown prefix and the remaining budget
    n = len(tok.encode(p.prompt))
    assert [len(c[0].prompt_ids) for c in engine.calls] == [n, n + 1, n + 2, n + 3]
    assert [c[0].params.max_new_tokens for c in engine.calls] == [8, 7, 6, 5]
    np.testing.assert_array_equal(e.tokens[n:], [OOV] * 3 + [tok.eos_id])
    np.testing.assert_array_equal(e.versions[n:], [0, 0, 0, 1])
    assert e.finish_reason == "stop" and e.num_turns == 1


def test_abort_limit_ends_episode(tok):
    task = CalculatorTask(max_turns=2)
    (p,) = task.problems("train", 1)
    engine = FakeEngine({p.id: [([OOV], [-0.5], 0, "abort")] * 4})
    engine.key_of = lambda r: p.id
    (e,) = run_episodes(
        engine, task, tok, [p], SamplingParams(max_new_tokens=8, temperature=1.0), max_aborts=2
    )
    assert e.finish_reason == "abort" and e.num_generated == 3 and len(engine.calls) == 3
