"""Orbax checkpoint <-> Hugging Face directory.

python -m launch.export CHECKPOINT_DIR OUT_DIR [--step N] [--tokenizer DIR] [--config RUN_YAML]
    The trainer's checkpoint (RUN_DIR/checkpoints) -> an HF directory (config.json,
    safetensors, tokenizer files) that transformers and vLLM load as is. The model shape comes
    from RUN_DIR/config.yaml (or --config), the tokenizer from RUN_DIR/tokenizer (or --tokenizer).

python -m launch.export --to-orbax HF_DIR CHECKPOINT_DIR [--config RUN_YAML]
    An HF directory -> a checkpoint the trainer resumes from (`launch.train --resume` with
    --run-dir the parent of CHECKPOINT_DIR): the params, a fresh optimizer state for the run
    config's optimizer, version 0. Without --config the run config is the defaults with
    model.init=hf, model.path=HF_DIR. The HF tokenizer files go to RUN_DIR/tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shutil
import sys

EXPORT_MANIFEST = "tandem_export.json"
# ModelConfig fields that do not change what the parameters compute.
_RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "attention_impl",
    "remat",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _run_config(config_path: str | None, checkpoint_dir: str):
    """The run config: --config, else the run directory's config.yaml."""
    from rl import config as C

    path = config_path or os.path.join(os.path.dirname(checkpoint_dir), "config.yaml")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"run config {path} not found; pass --config with the run's config.yaml"
        )
    return C.load(path)


def model_config_of(cfg, vocab_size: int):
    """The ModelConfig the trainer builds for a run config (vocab_size: the tokenizer's)."""
    from models.config import ModelConfig
    from rl.learner_setup import model_config

    if cfg.model.init == "hf":
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f))
    return model_config(cfg, vocab_size)


def rl_optimizer(cfg):
    """The RL-stage optimizer of a run config (the trainer's own)."""
    from rl.learner_setup import rl_optimizer as trainer_rl_optimizer

    return trainer_rl_optimizer(cfg)


def read_meta(checkpoint_dir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of a checkpoint (default: the latest)."""
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(os.path.abspath(checkpoint_dir))
    try:
        steps = list(mgr.all_steps())
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {checkpoint_dir}")
        if step not in steps:
            raise FileNotFoundError(
                f"--step {step}: no such checkpoint under {checkpoint_dir}; steps: {sorted(steps)}"
            )
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        mgr.close()
    return step, dict(meta)


def export_hf(
    checkpoint_dir: str,
    out_dir: str,
    *,
    step: int | None = None,
    tokenizer_dir: str | None = None,
    config_path: str | None = None,
    dtype: str | None = None,
) -> dict:
    """Writes checkpoint `step` (default latest) as an HF directory; returns its manifest."""
    from models.hf import save_hf_tensors, to_hf_tensors
    from models.tokenizer import load_tokenizer
    from rl.checkpoint import restore_params

    checkpoint_dir = os.path.abspath(checkpoint_dir)
    run_dir = os.path.dirname(checkpoint_dir)
    cfg = _run_config(config_path, checkpoint_dir)
    step, meta = read_meta(checkpoint_dir, step)
    state = restore_params(checkpoint_dir, step)
    # The learner checkpoints its (model, optimizer) state: item "0" is the model.
    params = state["0"] if set(state) == {"0", "1"} else state
    vocab_rows = int(params["model"]["embed_tokens"]["embedding"].shape[0])
    mcfg = model_config_of(cfg, vocab_rows)
    if tokenizer_dir is None and os.path.exists(os.path.join(run_dir, "tokenizer")):
        tokenizer_dir = os.path.join(run_dir, "tokenizer")
    if tokenizer_dir is not None:
        tok = load_tokenizer(tokenizer_dir)
        ids = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        mcfg = dataclasses.replace(
            mcfg, **{k: v for k, v in ids.items() if getattr(mcfg, k) is None}
        )
    else:
        print(f"note: no tokenizer (no {run_dir}/tokenizer, no --tokenizer)", file=sys.stderr)
    tensors = to_hf_tensors(mcfg, params, dtype=dtype)
    files = save_hf_tensors(mcfg, tensors, out_dir, tokenizer_dir=tokenizer_dir)
    chat = tokenizer_dir is not None and prompts_use_chat(cfg, tok)
    if tokenizer_dir is not None and not chat:
        files = _drop_chat_template(out_dir, files)
    manifest = {
        "checkpoint": checkpoint_dir,
        "step": step,
        "version": meta.get("version"),
        "run": cfg.name,
        "chat": chat,  # whether the run rendered its prompts with the chat template
        "files": sorted(files),
    }
    with open(os.path.join(out_dir, EXPORT_MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def prompts_use_chat(cfg, tokenizer) -> bool:
    """Whether a run of `cfg` rendered its prompts with the tokenizer's chat template."""
    from rl.tasks.chat import chat_enabled

    return chat_enabled(cfg.task.chat, tokenizer, preset=cfg.model.init != "hf")


def _drop_chat_template(out_dir: str, files: list[str]) -> list[str]:
    """Removes the chat template from an exported tokenizer (tokenizer_config.json's entry,
    chat_template.* files): the model was trained on plain prompts and never saw it, and a
    template would make chat-aware loaders (task.chat auto, vLLM's chat endpoint,
    apply_chat_template) render prompts it was not trained on."""
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
        if config.pop("chat_template", None) is not None:
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
    kept = []
    for name in files:
        if fnmatch.fnmatch(name, "chat_template.*"):
            os.remove(os.path.join(out_dir, name))
        else:
            kept.append(name)
    return kept


def _architecture(mcfg) -> dict:
    return {
        f.name: getattr(mcfg, f.name)
        for f in dataclasses.fields(mcfg)
        if f.name not in _RUNTIME_FIELDS
    }


def import_hf(hf_dir: str, checkpoint_dir: str, *, config_path: str | None = None) -> dict:
    """Writes an HF directory as a version-0 checkpoint the trainer resumes; returns its meta."""
    import jax

    from models import load_hf
    from models.config import ModelConfig
    from models.sharding import make_mesh
    from models.tokenizer import build_task_tokenizer, load_tokenizer
    from rl import config as C
    from rl.checkpoint import Checkpointer
    from rl.learner import Learner

    hf_dir = os.path.abspath(hf_dir)
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    run_dir = os.path.dirname(checkpoint_dir)
    if config_path:
        cfg = C.load(config_path)
    else:
        cfg = C.load(None, ["model.init=hf", f"model.path={json.dumps(hf_dir)}"])
    if os.path.isdir(checkpoint_dir) and any(n.isdigit() for n in os.listdir(checkpoint_dir)):
        raise FileExistsError(
            f"{checkpoint_dir} already holds checkpoints; choose an empty directory"
        )
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = ModelConfig.from_hf(json.load(f))

    tok_dir = os.path.join(run_dir, "tokenizer")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        if os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
            os.makedirs(tok_dir, exist_ok=True)
            for name in os.listdir(hf_dir):
                if name.startswith("tokenizer") or name in (
                    "special_tokens_map.json",
                    "added_tokens.json",
                    "chat_template.jinja",
                ):
                    shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tok_dir, name))
        else:
            build_task_tokenizer(tok_dir)  # what the trainer would do
    expected = model_config_of(cfg, load_tokenizer(tok_dir).vocab_size)
    want, got = _architecture(expected), _architecture(hf_config)
    diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    if diff:
        detail = ", ".join(f"{k}: run config {a!r} vs HF {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{hf_dir} does not match the model of the run config ({detail}); "
            f"use a run config with model.init=hf, model.path={hf_dir}"
        )

    mesh = make_mesh(devices=jax.devices()[:1])
    model = load_hf(hf_dir, mesh=mesh, param_dtype=expected.param_dtype)
    learner = Learner(model, rl_optimizer(cfg), mesh=mesh)
    from rl.buffer import GroupBuffer
    from rl.coordinator import Coordinator

    coord = Coordinator(1, 0)  # a fresh run's admission and buffer state
    meta = {
        "step": 0,
        "version": 0,
        "coordinator": coord.state(),
        "buffer": GroupBuffer(coord).state()[0],
        "sft_done": True,
        "source": hf_dir,
    }
    ckpt = Checkpointer(checkpoint_dir, keep=cfg.trainer.keep_checkpoints)
    try:
        ckpt.save(0, learner.state, meta, {})
    finally:
        ckpt.close()
    config_yaml = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(config_yaml):
        C.dump(cfg, config_yaml)
    return meta


def main(argv: list[str] | None = None) -> int:
    """Parses the command line and converts in the asked direction."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="CHECKPOINT_DIR (or HF_DIR with --to-orbax)")
    parser.add_argument("dst", help="OUT_DIR (or CHECKPOINT_DIR with --to-orbax)")
    parser.add_argument("--to-orbax", action="store_true", help="HF directory -> checkpoint")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default latest)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default RUN_DIR/tokenizer)")
    parser.add_argument("--config", help="run config YAML (default RUN_DIR/config.yaml)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help="dtype of the written tensors"
    )
    args = parser.parse_args(argv)
    if args.to_orbax and (args.step is not None or args.tokenizer or args.dtype):
        parser.error("--step, --tokenizer and --dtype apply to checkpoint -> HF only")

    from rl.config import ConfigError

    try:
        if args.to_orbax:
            meta = import_hf(args.src, args.dst, config_path=args.config)
            print(f"wrote checkpoint step 0 (version {meta['version']}) to {args.dst}")
        else:
            man = export_hf(
                args.src,
                args.dst,
                step=args.step,
                tokenizer_dir=args.tokenizer,
                config_path=args.config,
                dtype=args.dtype,
            )
            print(f"wrote step {man['step']} (version {man['version']}) to {args.dst}")
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
