"""python -m launch.bench publish: weight publication against a plain copy of the same bytes
(the goal: publishing a version costs at most twice copying its files)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from launch.benches.common import print_result
from models.hf import fsync_path

PRESETS = ("tiny", "qwen2_0p5b")  # the publish bench's models (random init, float32)


def copy_weights(src_dir: str, dst_dir: str) -> tuple[float, int]:
    """Copies the safetensors files of src_dir to dst_dir with fsync; (seconds, bytes)."""
    names = sorted(f for f in os.listdir(src_dir) if f.endswith(".safetensors"))
    if os.path.exists(dst_dir):
        shutil.rmtree(dst_dir)
    t0 = time.perf_counter()
    os.makedirs(dst_dir)
    nbytes = 0
    for name in names:
        dst = os.path.join(dst_dir, name)
        shutil.copyfile(os.path.join(src_dir, name), dst)
        fsync_path(dst)
        nbytes += os.path.getsize(dst)
    fsync_path(dst_dir)
    return time.perf_counter() - t0, nbytes


def make_checkpoint(preset: str, root: str, seed: int = 0):
    """A learner's Orbax checkpoint (random init, float32) under root/checkpoints; its config."""
    import jax
    import optax

    import models
    from rl.checkpoint import Checkpointer
    from rl.learner import Learner

    config = getattr(models, preset)(dtype="float32", param_dtype="float32")
    mesh = models.make_mesh(devices=jax.devices()[:1])
    learner = Learner(models.create_model(config, mesh, seed=seed), optax.sgd(0.0), mesh=mesh)
    ckpt = Checkpointer(os.path.join(root, "checkpoints"), keep=1)
    ckpt.save(0, learner.state, {"version": 0})
    ckpt.close()
    return config, learner


def breakdown(server, checkpoint_dir: str, out_dir: str) -> dict[str, float]:
    """One publication's parts timed alone (seconds): opening the checkpoint, reading every
    param (in parallel), and writing those arrays (convert, write, fsync, hash); a streamed
    publication overlaps the last two."""
    import concurrent.futures

    from models.hf import hf_tensor_plan, save_hf_tensors
    from rl.checkpoint import open_params
    from rl.param_server import io_workers

    stages = {}
    t0 = time.perf_counter()
    readers = open_params(checkpoint_dir)
    stages["open"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(io_workers()) as pool:
        arrays = dict(zip(readers, pool.map(lambda r: r.read(), readers.values())))
    stages["read"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tensors = hf_tensor_plan(server.config, arrays, dtype=server.dtype)
    save_hf_tensors(
        server.config,
        tensors,
        out_dir,
        tokenizer_dir=server.tokenizer_dir,
        max_shard_bytes=server.max_shard_bytes,
        digests={},
        workers=io_workers(),
    )
    stages["convert+write+fsync+sha256"] = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return stages


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(args) -> dict:
    """The benchmark; prints each figure and returns the RESULT values.

    A learner of the preset's shapes (random initialisation, float32 params) saves an Orbax
    checkpoint. Then, --repeats times (the median is reported):
      publish   ParamServer.publish from that checkpoint: read the params, convert to HF names
                and layout, write the safetensors shards + config + tokenizer + manifest of
                sha256s into weights/vN.tmp, fsync, rename, LATEST (reads overlap writes);
      reload    the same with a JaxEngine told to reload from the published directory
                (engine.update_weights(version, path)); with --vllm also a vLLM host launched
                here;
      copy      shutil.copyfile of the published safetensors files to another directory on the
                same disk, each file fsynced, then the directory.
    Before the timed repeats one publication is taken apart (open, read, convert + write +
    fsync + sha256, each alone) so a slow stage can be named. The RESULT line holds
    publish_s, copy_s, ratio (publish / copy), memory_s (publishing from params in memory),
    memory_ratio, reload_s (and vllm_reload_s with --vllm).
    """
    import jax

    from models.tokenizer import build_task_tokenizer
    from rl.checkpoint import restore_params
    from rl.param_server import ParamServer
    from rl.rollout.jax_engine import JaxEngine

    root = args.root or tempfile.mkdtemp(prefix="bench-publish-")
    os.makedirs(root, exist_ok=True)
    print(f"publish bench: preset {args.preset}, float32, {args.repeats} repeats, under {root}")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {os.cpu_count()} CPUs")
    try:
        t0 = time.perf_counter()
        config, learner = make_checkpoint(args.preset, root, seed=args.seed)
        took = time.perf_counter() - t0
        print(f"checkpoint of {config.num_params / 1e6:.1f} M params: {took:.1f} s")
        ckpt_dir = os.path.join(root, "checkpoints")
        tok_dir = build_task_tokenizer(os.path.join(root, "tokenizer"))
        server = ParamServer(
            os.path.join(root, "weights"),
            config,
            tokenizer_dir=tok_dir,
            keep=2,
            max_shard_bytes=args.max_shard_mb * 10**6,
        )

        stages = breakdown(server, ckpt_dir, os.path.join(root, "breakdown"))
        total = sum(stages.values())
        print("one publication by stage: " + ", ".join(f"{k} {v:.3f} s" for k, v in stages.items()))
        print(f"  (sum {total:.3f} s)")

        publish_s, copy_s, reload_s, vllm_s, memory_s = [], [], [], [], []
        host_params = restore_params(ckpt_dir)  # what the trainer publishes: params in memory
        nbytes = 0
        engine = JaxEngine(learner.model, version=0)
        del learner  # the engine holds its own copy
        vllm_engine = _launch_vllm(args, server, root) if args.vllm else None
        version = 0
        try:
            for rep in range(args.repeats):
                version += 1
                r = server.publish(version, checkpoint_dir=ckpt_dir)
                publish_s.append(r.restore_s + r.write_s)
                nbytes = r.bytes
                c, copied = copy_weights(r.path, os.path.join(root, "copy"))
                copy_s.append(c)
                version += 1
                memory_s.append(server.publish(version, params=host_params).write_s)
                version += 1
                r2 = server.publish(version, {"jax": engine}, checkpoint_dir=ckpt_dir)
                if r2.errors:
                    raise RuntimeError(f"JaxEngine reload failed: {r2.errors}")
                reload_s.append(r2.reload_s)
                line = (
                    f"repeat {rep}: publish {publish_s[-1]:.3f} s (restore {r.restore_s:.3f}, "
                    f"write {r.write_s:.3f}), from memory {memory_s[-1]:.3f} s, "
                    f"copy {c:.3f} s ({copied / 2**20:.1f} MiB), "
                    f"JaxEngine reload {r2.reload_s:.3f} s"
                )
                if vllm_engine is not None:
                    version += 1
                    r3 = server.publish(version, {"vllm": vllm_engine}, checkpoint_dir=ckpt_dir)
                    if r3.errors:
                        raise RuntimeError(f"vLLM reload failed: {r3.errors}")
                    vllm_s.append(r3.reload_s)
                    line += f", vLLM reload {r3.reload_s:.3f} s"
                print(line, flush=True)
        finally:
            if vllm_engine is not None:
                vllm_engine.close()
        p, c, m = _median(publish_s), _median(copy_s), _median(memory_s)
        print(
            f"median of {args.repeats}: publish {p:.3f} s ({nbytes / p / 2**30:.2f} GiB/s), "
            f"copy {c:.3f} s ({nbytes / c / 2**30:.2f} GiB/s), ratio {p / c:.2f}; from memory "
            f"{m:.3f} s (ratio {m / c:.2f}); + JaxEngine reload {_median(reload_s):.3f} s"
        )
        out = dict(
            publish_s=p,
            copy_s=c,
            ratio=p / c,
            memory_s=m,
            memory_ratio=m / c,
            reload_s=_median(reload_s),
        )
        if vllm_s:
            out["vllm_reload_s"] = _median(vllm_s)
        return out
    finally:
        if not args.keep and not args.root:
            shutil.rmtree(root, ignore_errors=True)


def _launch_vllm(args, server, root):
    """A vLLM host on version 0 of the checkpoint, wrapped in a VLLMEngine that owns it."""
    from rl.checkpoint import restore_params
    from rl.rollout.vllm import VLLMEngine
    from rl.rollout.vllm_host import VLLMHost

    path, _ = server.write(0, restore_params(os.path.join(root, "checkpoints")))
    host = VLLMHost.launch(path, log_path=os.path.join(root, "vllm.log"), max_model_len=512)
    print(f"vLLM host: {host.describe()}", flush=True)
    host.wait_ready(args.vllm_ready_s)
    server.engine_versions["vllm"] = 0
    return VLLMEngine([host], version=0, owns_hosts=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench publish", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-mb", type=int, default=500, help="ParamServer shard size (1e6 B)")
    p.add_argument("--vllm", action="store_true", help="also time a vLLM host's reload")
    p.add_argument("--vllm-ready-s", type=float, default=600.0, help="vLLM startup deadline")
    p.add_argument("--root", help="work directory (default: a temp dir, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temp work directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the publish benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if args.repeats < 1:
        print(f"--repeats={args.repeats} must be positive", file=sys.stderr)
        return 2
    print_result(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
