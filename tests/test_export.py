"""launch.export: a trained run's checkpoint -> HF (checked with transformers) -> checkpoint."""

import json
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
import yaml

from launch import export as E
from models import sharding as msh
from rl import config as C
from rl.checkpoint import restore_params
from rl.learner_setup import model_config
from rl.trainer import Trainer, train

pytestmark = pytest.mark.slow  # each test needs a trained run (module fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "configs", "default.yaml")
TINY = [
    "sft.steps=5",
    "sft.batch_size=16",
    "trainer.total_updates=2",
    "rollout.prompts_per_update=4",
    "rollout.group_size=4",
    "task.num_eval=16",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.save_episodes=0",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny run trained for 2 updates (supervised warm start first)."""
    path = str(tmp_path_factory.mktemp("run"))
    summary = train(C.load(BASE, TINY), run_dir=path)
    assert math.isfinite(summary["loss/loss"])
    return path


@pytest.fixture(scope="module")
def hf_dir(run_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    assert E.main([os.path.join(run_dir, "checkpoints"), out]) == 0
    return out


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(2, 16), dtype=np.int32)


def _torch_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    """Logits of the HF directory under transformers, float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def _restored_trainer(cfg, run_dir) -> Trainer:
    trainer = Trainer(cfg, run_dir=run_dir, resume=True)
    assert trainer.restored is not None, "the trainer restored no checkpoint"
    return trainer


def test_export_matches_learner_logits(run_dir, hf_dir):
    from transformers import AutoTokenizer

    files = set(os.listdir(hf_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    manifest = json.load(open(os.path.join(hf_dir, E.EXPORT_MANIFEST)))
    assert (manifest["step"], manifest["version"]) == (2, 2)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    cfg_json = json.load(open(os.path.join(hf_dir, "config.json")))
    assert cfg_json["eos_token_id"] == hf_tok.eos_token_id is not None

    cfg = C.load(os.path.join(run_dir, "config.yaml"))
    trainer = _restored_trainer(cfg, run_dir)
    try:
        assert trainer.learner.version == 2
        tokens = _tokens(trainer.tokenizer.vocab_size)
        ours = np.asarray(jax.device_get(trainer.learner.model(tokens)), np.float32)
        init = msh.create_model(
            model_config(cfg, trainer.tokenizer.vocab_size), trainer.learner.mesh, seed=cfg.seed
        )
        untrained = np.asarray(jax.device_get(init(tokens)), np.float32)
    finally:
        trainer.writer.close()
        trainer.learner.ckpt.close()  # the learner holds its Checkpointer (learner contract)
    theirs = _torch_logits(hf_dir, tokens)
    assert ours.shape == theirs.shape == (2, 16, cfg_json["vocab_size"])
    # the trained weights (not the initial ones, not an all-zero head) are what was exported
    assert np.abs(ours).max() > 0.1 and np.abs(ours - untrained).max() > 0.1
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_export_of_a_plain_prompt_run_has_no_chat_template(run_dir, hf_dir, tmp_path):
    """The run trained on plain prompts (a preset): its export carries no chat template, so a
    run from the export (task.chat auto) renders the very prompts the model was trained on."""
    from transformers import AutoTokenizer

    from rl import build

    assert json.load(open(os.path.join(hf_dir, E.EXPORT_MANIFEST)))["chat"] is False
    assert "chat_template" not in json.load(open(os.path.join(hf_dir, "tokenizer_config.json")))
    assert AutoTokenizer.from_pretrained(hf_dir).chat_template is None
    trained = C.load(os.path.join(run_dir, "config.yaml"))
    assert build.make_tokenizer(trained, run_dir)[1].chat_template is not None  # the run's own
    again = C.load(BASE, TINY + ["model.init=hf", f"model.path={hf_dir}"])
    tasks = [
        build.make_task(cfg, build.make_tokenizer(cfg, str(tmp_path / name))[1])
        for name, cfg in (("trained", trained), ("again", again))
    ]
    try:
        prompts = [[p.prompt for p in t.problems("eval", 8)] for t in tasks]
        assert not any(t.chat for t in tasks) and prompts[0] == prompts[1]
    finally:
        for t in tasks:
            t.close()


def test_hf_to_orbax_resumes_training(run_dir, hf_dir, tmp_path):
    new_run = str(tmp_path / "imported")
    ckpt = os.path.join(new_run, "checkpoints")
    config = os.path.join(run_dir, "config.yaml")
    assert E.main(["--to-orbax", hf_dir, ckpt, "--config", config]) == 0
    assert E.main(["--to-orbax", hf_dir, ckpt, "--config", config]) == 2  # never overwrites

    # The checkpoint holds the HF tensors (torch layout transposed back), fresh Adam state.
    state = restore_params(ckpt)
    hf = safetensors.numpy.load_file(os.path.join(hf_dir, "model.safetensors"))
    flat = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = np.asarray(v)

    walk(state, "")

    def hf_tensor(name: str) -> np.ndarray:  # name: an nnx path of one layer (or none)
        stem, leaf = name.rsplit(".", 1)
        if leaf == "kernel":  # torch Linear weights are (out, in)
            return hf[f"{stem}.weight"].T
        if leaf == "embedding":
            return hf[f"{stem}.weight"]
        return hf[name]

    compared = 0
    for name, value in flat.items():
        if name.startswith("model.layers."):  # stacked: slice i is HF's model.layers.{i}
            rest = name[len("model.layers.") :]
            for i, layer in enumerate(value):
                ref = hf_tensor(f"model.layers.{i}.{rest}")
                np.testing.assert_array_equal(layer, ref, err_msg=f"{name}[{i}]")
                compared += 1
        else:
            np.testing.assert_array_equal(value, hf_tensor(name), err_msg=name)
            compared += 1
    assert compared == len(hf)  # every HF tensor, once
    opt = ocp.CheckpointManager(os.path.abspath(ckpt)).restore(
        0, args=ocp.args.Composite(optimizer=ocp.args.StandardRestore())
    )["optimizer"]
    opt_leaves = jax.tree.leaves(opt)
    assert opt_leaves and all(not np.asarray(x).any() for x in opt_leaves)  # moments, counts 0
    step, meta = E.read_meta(ckpt)
    assert (step, meta["version"], meta["buffer"]["next_group"]) == (0, 0, 0)
    assert meta["coordinator"]["dispatched"] == 0
    assert os.path.exists(os.path.join(new_run, "tokenizer", "tokenizer.json"))

    cfg = C.load(config)
    trainer = _restored_trainer(cfg, new_run)
    assert trainer.learner.version == 0
    tokens = _tokens(trainer.tokenizer.vocab_size)
    ours = np.asarray(jax.device_get(trainer.learner.model(tokens)), np.float32)
    np.testing.assert_allclose(ours, _torch_logits(hf_dir, tokens), atol=1e-5, rtol=0)
    summary = trainer.run()  # == train(cfg, run_dir=new_run, resume=True)

    with open(os.path.join(new_run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["version"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/loss"]) for r in rows)
    assert math.isfinite(summary["loss/loss"]) and "eval/accuracy" in rows[-1]
    step, meta = E.read_meta(ckpt)
    assert (step, meta["version"]) == (2, 2)


def test_import_refuses_a_model_of_another_shape(hf_dir, tmp_path):
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump({"model": {"preset": "qwen2_0p5b"}}))
    with pytest.raises(ValueError, match="hidden_size: run config 896 vs HF 128"):
        E.import_hf(hf_dir, str(tmp_path / "r" / "checkpoints"), config_path=str(config))


def test_export_errors(run_dir, tmp_path, capsys):
    ckpt = os.path.join(run_dir, "checkpoints")
    assert E.main([ckpt, str(tmp_path / "x"), "--step", "7"]) == 2
    assert "--step 7: no such checkpoint" in capsys.readouterr().err
    lone = tmp_path / "lone" / "checkpoints"
    lone.mkdir(parents=True)
    assert E.main([str(lone), str(tmp_path / "y")]) == 2
    assert "config.yaml not found" in capsys.readouterr().err
