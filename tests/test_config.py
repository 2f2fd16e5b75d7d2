"""Config validation: every bad input names the key, the value and what is valid."""

import pytest
import yaml

from rl import config as C


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_and_overrides_coerce_types():
    cfg = C.load(
        None,
        [
            "optim.lr=1e-3",
            "trainer.mode=async",
            "trainer.max_staleness=2",
            "rollout.vllm.urls=[http://a:1, http://b:2]",
            "algorithm.dual_clip_c=3",
        ],
    )
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.trainer.mode == "async" and cfg.trainer.max_staleness == 2
    assert cfg.rollout.vllm.urls == ["http://a:1", "http://b:2"]
    assert cfg.algorithm.dual_clip_c == 3.0 and isinstance(cfg.algorithm.dual_clip_c, float)


def test_resolved_config_round_trips(tmp_path):
    cfg = C.load(None, ["sft.steps=7", "task.options={digits: 3}"])
    C.dump(cfg, str(tmp_path / "config.yaml"))
    again = C.load(str(tmp_path / "config.yaml"))
    assert again == cfg and again.task.options == {"digits": 3}


@pytest.mark.parametrize(
    "text, overrides, expected",
    [
        # 1. typo in a key -> closest key suggested
        ("optim:\n  lrr: 0.1\n", [], ["optim.lrr", "unknown key", "did you mean 'lr'"]),
        # 2. unknown section
        ("trainr:\n  mode: sync\n", [], ["trainr", "unknown key", "did you mean 'trainer'"]),
        # 3. bad enum value, with the valid choices and a suggestion
        (
            "trainer:\n  mode: asynch\n",
            [],
            ["trainer.mode", "'asynch'", "'one_step_off'", "did you mean 'async'"],
        ),
        # 4. wrong type
        ("rollout:\n  group_size: eight\n", [], ["rollout.group_size", "expected int", "'eight'"]),
        # 5. bool expected
        ("logging:\n  tensorboard: maybe\n", [], ["logging.tensorboard", "expected bool", "maybe"]),
        # 6. wrong type through --set
        ("", ["optim.lr=fast"], ["optim.lr", "expected float", "'fast'"]),
        # 7. missing required field for the chosen option
        ("model:\n  init: hf\n", [], ["model.path", "missing", "model.init is 'hf'"]),
        # 8. impossible combination
        ("trainer:\n  max_staleness: 3\n", [], ["trainer.max_staleness", "3", "'sync'", "async"]),
        # 9. out of range
        ("rollout:\n  top_p: 1.5\n", [], ["rollout.top_p", "1.5", "(0, 1]"]),
        # 10. section given a scalar
        ("optim: 3\n", [], ["optim", "expected a mapping", "3"]),
        # 11. GRPO with groups of one
        ("rollout:\n  group_size: 1\n", [], ["rollout.group_size", "1", "at least 2"]),
        # 12. malformed override
        ("", ["optim.lr"], ["optim.lr", "key.path=value"]),
        # 13. micro-batch that does not divide the batch
        ("learner:\n  micro_batch_size: 7\n", [], ["learner.micro_batch_size", "7", "divide"]),
        # 14. loss name typo
        ("algorithm:\n  loss: ppo\n", [], ["algorithm.loss", "'ppo'", "'ppo_clip'"]),
        # 15. packing with a sequence-level loss
        (
            "learner:\n  pack: true\nalgorithm:\n  loss: gspo\n",
            [],
            ["learner.pack", "'gspo'", "token-level", "pack: false"],
        ),
        # 17. unknown model shape field
        ("model:\n  overrides: {layers: 4}\n", [], ["model.overrides.layers", "num_hidden_layers"]),
        # 18. bad model shape value
        (
            "",
            ["model.overrides={hidden_size: -8}"],
            ["model.overrides.hidden_size", "-8", "positive"],
        ),
        # 19. a rollout process of its own runs the JAX sampler, on the local transport
        (
            "trainer:\n  placement: process\nrollout:\n  engine: vllm\n",
            [],
            ["trainer.placement", "'process'", "rollout.engine is 'vllm'", "auto, in_process"],
        ),
        (
            "",
            ["trainer.placement=split", "trainer.transport=ray"],
            ["trainer.placement", "'split'", "trainer.transport 'local'", "auto, in_process"],
        ),
        (
            "",
            ["trainer.placement=in_process", "trainer.pin_cores=true"],
            ["trainer.pin_cores", "'in_process'", "auto, process"],
        ),
        # a rollout hang deadline that is not positive, or outlasts the run's deadline
        ("", ["trainer.rollout_hang_s=0"], ["trainer.rollout_hang_s", "must be > 0"]),
        (
            "",
            ["trainer.rollout_hang_s=700", "trainer.deadline_s=600"],
            ["trainer.rollout_hang_s", "700", "trainer.deadline_s (600.0)"],
        ),
        # a warm-start accuracy target out of range, or without the learner in this process
        ("", ["sft.target_accuracy=1.5"], ["sft.target_accuracy", "1.5", "[0, 1]"]),
        (
            "",
            ["sft.target_accuracy=0.2", "trainer.transport=ray"],
            ["sft.target_accuracy", "0.2", "'ray'", "set sft.target_accuracy: 0"],
        ),
        ("", ["sft.check_every=0"], ["sft.check_every", "0", "must be > 0"]),
        # one optimizer for both stages, whose schedule cannot know where a target stops
        (
            "",
            ["sft.steps=300", "sft.target_accuracy=0.2", "sft.continue_optimizer=true"],
            ["sft.continue_optimizer", "True", "after sft.steps (300)", "sft.target_accuracy: 0"],
        ),
        # in-flight weight updates: the JAX sampler only
        (
            "",
            ["trainer.partial=inflight", "rollout.engine=vllm"],
            ["trainer.partial", "'inflight'", "'vllm'", "drain, continue"],
        ),
        # 16. packing with a per-sequence aggregation
        (
            "learner:\n  pack: true\nalgorithm:\n  aggregation: seq_mean_token_mean\n",
            [],
            ["learner.pack", "'seq_mean_token_mean'", "'token_mean'"],
        ),
    ],
)
def test_bad_configs_give_clear_errors(tmp_path, text, overrides, expected):
    path = _write(tmp_path, text) if text else None
    with pytest.raises(C.ConfigError) as info:
        C.load(path, overrides)
    msg = str(info.value)
    for piece in expected:
        assert piece in msg, (piece, msg)
    if path:
        assert path in msg


def test_invalid_yaml_names_file(tmp_path):
    path = _write(tmp_path, "optim: [unclosed\n")
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load(path)


def test_every_shipped_config_validates():
    import glob

    files = [f for f in glob.glob("configs/*.yaml")]
    assert files, "no configs shipped"
    for f in files:
        with open(f) as fh:
            assert isinstance(yaml.safe_load(fh), dict), f
        C.load(f)


def test_model_overrides_reach_the_model():
    from rl.learner_setup import model_config

    cfg = C.load(
        None, ["model.overrides={hidden_size: 256, num_attention_heads: 8, num_hidden_layers: 3}"]
    )
    m = model_config(cfg, vocab_size=100)
    assert (m.hidden_size, m.num_hidden_layers, m.intermediate_size) == (256, 3, 512)
    bad = C.load(None, ["model.overrides={num_attention_heads: 3}"])  # kv heads 2 do not divide 3
    with pytest.raises(C.ConfigError, match="model.overrides"):
        model_config(bad, vocab_size=100)
