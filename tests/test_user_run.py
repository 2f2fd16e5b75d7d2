"""A run the way a user's goes: an HF checkpoint directory with its own byte-level BPE tokenizer
and chat template, a JSONL data file, and a reward from the user's own module in TRL's or
verl's signature. The dumped episodes decode, with the checkpoint's tokenizer in transformers,
to the data set's prompts rendered by transformers' apply_chat_template; the run's published
and exported directories carry that tokenizer."""

import json
import os
import sys

import pytest
import transformers
from flax import nnx
from run_files import metric_rows, trained_episodes

from models import config as mc
from models import sharding as msh
from models.hf import save_hf_tensors, to_hf_tensors
from models.tokenizer import build_bpe_tokenizer, load_tokenizer
from rl import config as C
from rl.trainer import train

PROMPTS = [f"Ana has {i} pens. Then Ana buys {i % 7 + 2} more. How many?" for i in range(60)]
USER_MODULE = '''
from rl.rewards import register_reward

CALLS = []

def trl_accuracy(completions, prompts, answer, **kwargs):
    """TRL's signature: a conversational row gives message lists."""
    assert isinstance(prompts[0], list) and prompts[0][-1]["role"] == "user"
    return [float(c[0]["content"].strip().endswith(a)) for c, a in zip(completions, answer)]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature."""
    assert data_source == "user/pens"
    return {"score": 0.5 if ground_truth in solution_str else 0.0}

@register_reward("ends_with_digit")
def ends_with_digit(completion, answer):
    return float(completion[-1:].isdigit())
'''


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """(checkpoint dir, train file, module dir): a random tiny model with a BPE tokenizer whose
    chat turn ends with <|im_end|>, 60 chat rows, and the user's reward module."""
    root = tmp_path_factory.mktemp("user")
    rows = [
        {
            "prompt": [{"role": "user", "content": p}],
            "answer": str(i + i % 7 + 2),
            "data_source": "user/pens",
        }
        for i, p in enumerate(PROMPTS)
    ]
    train_file = root / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok_dir = build_bpe_tokenizer(str(root / "tok"), PROMPTS * 5, vocab_size=300)
    tok = load_tokenizer(tok_dir).with_turn_end()
    config = mc.tiny(vocab_size=320, eos_token_id=tok.end_ids, pad_token_id=tok.pad_id)
    model = msh.create_model(config, msh.make_mesh(1, 1, 1), seed=0)
    ckpt = str(root / "checkpoint")
    save_hf_tensors(
        config, to_hf_tensors(config, nnx.state(model, nnx.Param)), ckpt, tokenizer_dir=tok_dir
    )
    module_dir = root / "mods"
    module_dir.mkdir()
    (module_dir / "user_rewards.py").write_text(USER_MODULE)
    return ckpt, str(train_file), str(module_dir)


def _cfg(tmp_path, ckpt, train_file, *overrides):
    return C.load(
        None,
        [
            f"run_root={tmp_path}",
            "name=user",
            "imports=[user_rewards]",
            "model.init=hf",
            f"model.path={ckpt}",
            "task.name=dataset",
            f"task.options.train_files=[{train_file}]",
            "task.options.eval_fraction=0.2",
            "task.options.rewards=[{function: 'user_rewards:trl_accuracy'}, "
            "{function: 'user_rewards:compute_score', weight: 0.5}, "
            "{name: ends_with_digit, weight: 0.1}]",
            "task.num_eval=4",
            "task.eval_samples=2",
            "sft.steps=0",
            "rollout.group_size=2",
            "rollout.prompts_per_update=2",
            "rollout.max_new_tokens=6",
            "rollout.batch_size=8",
            "trainer.total_updates=2",
            "trainer.placement=in_process",
            "logging.tensorboard=false",
            "logging.progress=false",
            *overrides,
        ],
    )


def _check_run(run_dir, ckpt, train_file):
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    rows = [json.loads(line) for line in open(train_file)]
    rendered = {
        tuple(hf.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False))
        for r in rows
    }
    episodes = trained_episodes(run_dir)
    assert len(episodes) == 2 * 2 * 2
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    for e in episodes.values():
        ids = e["token_ids"]
        n = len(hf.encode(e["prompt"], add_special_tokens=False))
        assert tuple(ids[:n]) in rendered  # the prompt, token for token as transformers has it
        assert hf.decode(ids[:n]) == e["prompt"]
        assert im_end not in ids[n:-1]  # the chat's end of turn ends a generation
    rows = metric_rows(run_dir)
    assert {"eval/pass@1", "eval/pass@2", "eval/maj@2"} <= set(rows[0]) & set(rows[-1])
    assert rows[-1]["reward/errors"] == 0.0 and rows[-1]["reward/timeouts"] == 0.0
    with (
        open(os.path.join(run_dir, "tokenizer", "tokenizer.json")) as f,
        open(os.path.join(ckpt, "tokenizer.json")) as g,
    ):
        assert f.read() == g.read()


@pytest.mark.slow
def test_a_users_checkpoint_data_and_rewards_with_the_jax_sampler(
    user_files, tmp_path, monkeypatch
):
    ckpt, train_file, module_dir = user_files
    monkeypatch.syspath_prepend(module_dir)
    monkeypatch.setenv("PYTHONPATH", module_dir)  # the reward workers import it too
    train(_cfg(tmp_path, ckpt, train_file))
    run_dir = os.path.join(tmp_path, "user")
    _check_run(run_dir, ckpt, train_file)
    from launch.export import main as export

    out = str(tmp_path / "exported")
    assert export([os.path.join(run_dir, "checkpoints"), out]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported.get_vocab() == transformers.AutoTokenizer.from_pretrained(ckpt).get_vocab()
    assert exported.chat_template == transformers.AutoTokenizer.from_pretrained(ckpt).chat_template
    _greedy_answers_agree(out, exported, train_file)


def _greedy_answers_agree(hf_dir, hf_tok, train_file):
    """The exported policy decodes greedily to the same tokens in transformers as in the JAX
    sampler, stopping at the chat's end of turn."""
    import numpy as np
    import torch

    from models import load_hf
    from rl.rollout.base import GenerationRequest, SamplingParams
    from rl.rollout.jax_engine import JaxEngine

    rows = [json.loads(line) for line in open(train_file)][:4]
    stop = tuple(load_tokenizer(hf_dir).with_turn_end().end_ids)
    engine = JaxEngine(load_hf(hf_dir), version=0, max_batch=4)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    try:
        for i, r in enumerate(rows):
            ids = hf_tok.apply_chat_template(
                r["prompt"], add_generation_prompt=True, return_dict=False
            )
            params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=stop)
            ours = engine.generate([GenerationRequest(f"r{i}", np.asarray(ids, np.int32), params)])
            out = torch_model.generate(
                torch.tensor([ids]),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=list(stop),
                pad_token_id=hf_tok.pad_token_id,
            )[0, len(ids) :].tolist()
            assert ours[0].token_ids.tolist() == out
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_users_checkpoint_with_a_vllm_host(user_files, tmp_path, monkeypatch):
    ckpt, train_file, module_dir = user_files
    monkeypatch.syspath_prepend(module_dir)
    monkeypatch.setenv("PYTHONPATH", module_dir)
    train(_cfg(tmp_path, ckpt, train_file, "rollout.engine=vllm", "trainer.mode=sync"))
    run_dir = os.path.join(tmp_path, "user")
    _check_run(run_dir, ckpt, train_file)
    published = sorted(os.listdir(os.path.join(run_dir, "weights")))
    last = os.path.join(run_dir, "weights", [p for p in published if p.startswith("v")][-1])
    with open(os.path.join(last, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]


def _docs_block(start: str) -> str:
    """The python block of docs/data.md whose first line is `start`."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "data.md")).read()
    for block in text.split("```python\n")[1:]:
        code = block.split("```")[0]
        if code.startswith(start):
            return code
    raise AssertionError(f"no python block starting {start!r} in docs/data.md")


@pytest.fixture
def registries():
    """The global task and reward registries, put back as they were after the test."""
    from rl.rewards import REWARDS
    from rl.tasks import TASKS

    saved = [(r, dict(r)) for r in (TASKS, REWARDS)]
    yield TASKS, REWARDS
    for registry, before in saved:
        registry.clear()
        registry.update(before)
    for name in ("my_tasks", "my_rewards"):
        sys.modules.pop(name, None)


def test_the_docs_task_and_reward_register_from_a_users_module(tmp_path, monkeypatch, registries):
    from rl import build

    tasks, rewards = registries
    (tmp_path / "my_tasks.py").write_text(_docs_block("# my_tasks.py"))
    (tmp_path / "my_rewards.py").write_text(_docs_block("# my_rewards.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = C.load(None, ["imports=[my_rewards, my_tasks]", "task.name=echo", "sft.steps=0"])
    task = build.make_task(cfg, build.make_tokenizer(cfg, str(tmp_path / "run"))[1])
    p = task.problems("eval", 3)[2]
    assert (p.prompt, task.reward(p, " 2 ").correct, task.reward(p, "3").reward) == (
        "Say 2.",
        True,
        0.0,
    )
    assert rewards["starts_with_thinking"].fn("Let me see", "1") == 1.0
    with pytest.raises(C.ConfigError, match=r"imports\[0\]: cannot import 'not_there'"):
        C.load(None, ["imports=[not_there]"])
