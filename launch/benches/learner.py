"""python -m launch.bench learner: the real Learner.update (jit, donated state) on a synthetic RL
batch, timed, with model FLOPs per token and MFU against the datasheet bf16 peak."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from launch.benches.common import (
    add_model_arguments,
    default_attention,
    device_summary,
    fmt,
    kernel_profile,
    model_config,
    peak_memory_gib,
    print_result,
    reject_nonpositive,
    timed,
)

CHUNK_TARGET = 16384  # auto log-prob chunk: the vocabulary in equal chunks of at most this


def auto_chunk(vocab: int) -> int:
    """A log-prob chunk that splits the vocabulary into equal multiples of 128 near 16384."""
    n = -(-vocab // CHUNK_TARGET)
    return -(-vocab // n // 128) * 128 if n > 1 else vocab


@dataclasses.dataclass(frozen=True)
class LearnerFlops:
    """FLOPs per token of one training step (forward + backward)."""

    matmul_params: int  # N: layer matmul weights + LM head
    model: float  # 6 N + 12 L T q_dim
    model_causal: float  # 6 N + 6 L T q_dim (the causal half of the scores)
    executed: float  # estimate of what runs: model + recomputed forward work


def learner_flops(cfg, seq_len: int, *, remat: str = "none", chunk: int = 0) -> LearnerFlops:
    """Model and executed FLOPs per token of a train step over rows of seq_len tokens.

    Model FLOPs per token follow the PaLM convention (Chowdhery et al. 2022, appendix B):
      6 * N + 12 * L * T * (num_heads * head_dim)
    with N the weights of every matmul: per layer q/k/v/o and gate/up/down, plus the LM head
    (counted even when tied to the embedding). The embedding lookup, biases and norms are
    excluded; attention is counted for the full T x T score matrix (not halved for causality;
    the halved figure is model_causal, printed as mfu_causal). Rematerialised work is not model
    FLOPs: it is in `executed`.
    """
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = D * q + 2 * D * kv + q * D + 3 * D * F
    n = L * layer + D * V
    attn_fwd = 4 * L * seq_len * q  # QK^T and PV, full T x T
    model = 6 * n + 3 * attn_fwd
    executed = model
    if remat == "full":  # every layer's forward again in the backward pass
        executed += 2 * L * layer + attn_fwd
    elif remat == "dots_saveable":  # matmuls saved; the attention kernel is not a dot: recomputed
        executed += attn_fwd
    if 0 < chunk < V:  # each log-prob chunk's logits are recomputed in the backward pass
        executed += 2 * D * V
    return LearnerFlops(n, float(model), float(6 * n + 1.5 * attn_fwd), float(executed))


def synthetic_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    """A TrainBatch of random rows of seq targets: the second half trained, random advantages."""
    from rl.learner import make_batch
    from rl.types import Episode

    rng = np.random.default_rng(seed)
    prompt_len = seq // 2 + 1  # targets seq // 2 + 1 .. seq are trained: seq - seq // 2 of them
    episodes = []
    for b in range(batch):
        mask = np.zeros(seq + 1, np.int8)
        mask[prompt_len:] = 1
        noise = 0.1 * rng.standard_normal(seq + 1)
        episodes.append(
            Episode(
                problem_id=f"bench{b}",
                tokens=rng.integers(0, vocab, seq + 1),
                loss_mask=mask,
                behavior_logp=np.where(mask > 0, -math.log(vocab) + noise, 0.0),
                versions=np.where(mask > 0, 0, -1),
                prompt_len=prompt_len,
                reward=0.0,
            )
        )
    return make_batch(episodes, rng.standard_normal(batch).tolist(), row_len=seq)


def bench_learner(args) -> dict:
    """Times Learner.update on a synthetic batch; prints and returns the figures."""
    from models import create_model, make_mesh
    from rl import distributed
    from rl.learner import Learner, StepConfig, make_optimizer

    # --hosts N: this process is one of N (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    # JAX_PROCESS_ID, or the cluster's own variables), each giving the mesh devices / N devices.
    distributed.initialize(args.hosts)
    kind, peak_flops, _ = device_summary()
    attention = args.attention or default_attention()
    cfg = model_config(
        args.preset,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        attention_impl=attention,
        remat=args.remat,
    )
    chunk = auto_chunk(cfg.vocab_size) if args.chunk is None else args.chunk
    B, T = args.batch, args.seq
    print(
        f"learner: {args.preset} params={cfg.param_dtype} compute={cfg.dtype} remat={cfg.remat} "
        f"attention={attention} logprob_chunk={chunk} segments={args.segments} "
        f"batch={B}x{T} loss=ppo_clip"
    )
    if args.devices % args.hosts:
        raise ValueError(f"--devices {args.devices} does not split over --hosts {args.hosts}")
    per_host = args.devices // args.hosts
    devices = distributed.process_devices(per_host) if args.hosts > 1 else jax.devices()
    mesh = make_mesh(1, args.devices, 1, devices=devices[: args.devices])  # fsdp over all
    print(f"mesh: fsdp={args.devices} over {args.hosts} process(es), {per_host} device(s) each")
    t0 = time.perf_counter()
    model = create_model(cfg, mesh, seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    print(f"model init: {time.perf_counter() - t0:.1f} s ({cfg.num_params / 1e6:.1f} M params)")
    total = args.warmup + args.steps
    tx = make_optimizer(1e-6, total_steps=total)
    learner = Learner(
        model,
        tx,
        mesh=mesh,
        step_cfg=StepConfig(logprob_chunk=chunk),
        gemm_autotune=args.gemm_autotune,
    )
    batch = synthetic_batch(cfg.vocab_size, B, T, seed=args.seed)
    if args.segments == "none":  # rows are unpacked: drop the segment mask
        batch = {k: v for k, v in batch.arrays().items() if k != "segment_ids"}
    if args.compile_only:
        return _compile_times(learner, batch, args)
    times = []
    for i in range(total):
        t0 = time.perf_counter()
        met = learner.update(batch)
        jax.block_until_ready(learner.state)
        times.append(time.perf_counter() - t0)
        if not math.isfinite(met["loss"]):
            raise RuntimeError(f"learner step {i}: loss={met['loss']} is not finite")
        if i < args.warmup:
            print(f"warmup step {i}: {times[-1]:.3f} s (loss {met['loss']:.4f})")
    timed_steps = times[args.warmup :]
    step_s = statistics.median(timed_steps)
    tokens = B * T
    fl = learner_flops(cfg, T, remat=cfg.remat, chunk=chunk)
    flops_s = fl.model * tokens / step_s
    peak_flops = peak_flops * args.devices if peak_flops else peak_flops  # the whole mesh's
    mfu = flops_s / peak_flops if peak_flops else None
    mfu_causal = fl.model_causal * tokens / step_s / peak_flops if peak_flops else None
    hfu = fl.executed * tokens / step_s / peak_flops if peak_flops else None
    print(
        f"step: median {step_s * 1e3:.1f} ms over {len(timed_steps)} steps "
        f"(min {min(timed_steps) * 1e3:.1f}, max {max(timed_steps) * 1e3:.1f})"
    )
    print(f"tokens/s: {tokens / step_s:,.0f} ({tokens // 2:,} of {tokens:,} tokens trained)")
    print(
        f"model FLOPs/token: {fl.model / 1e9:.3f} G = 6 * {fl.matmul_params / 1e6:.1f} M "
        f"+ 12 * L * T * q_dim; executed (with recompute) ~{fl.executed / 1e9:.3f} G"
    )
    print(f"model TFLOP/s: {flops_s / 1e12:.1f}; peak: {fmt(peak_flops and peak_flops / 1e12)}")
    print(f"MFU: {fmt(mfu)}  (causal-halved attention: {fmt(mfu_causal)}; HFU ~{fmt(hfu)})")
    mem = peak_memory_gib()
    if mem is not None:
        print(f"peak device memory: {mem:.1f} GiB")
    if args.breakdown:
        _learner_breakdown(learner, batch, chunk, fl, step_s, peak_flops)
    if args.profile:
        kernel_profile(lambda: learner.update(batch), lambda: learner.state)
    ckpt = _checkpoint_times(learner, batch) if args.checkpoint else {}
    return dict(
        **ckpt,
        learner_tokens_per_s=tokens / step_s,
        mfu=mfu,
        step_s=step_s,
        mfu_causal=mfu_causal,
        hfu=hfu,
        model_tflops=flops_s / 1e12,
    )


def _compile(name: str, lower) -> dict:
    """Seconds to lower (`lower()`) and to compile a program, nothing run: wall and this
    process's CPU time (steadier than wall on a shared machine); printed."""
    w0, c0 = time.perf_counter(), time.process_time()
    lowered = lower()
    w1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    w2, c2 = time.perf_counter(), time.process_time()
    print(
        f"{name}: lower {w1 - w0:.2f} s, compile {w2 - w1:.2f} s, total {w2 - w0:.2f} s "
        f"(CPU time: lower {c1 - c0:.2f} s, compile {c2 - c1:.2f} s)"
    )
    return dict(lower_s=w1 - w0, compile_s=w2 - w1, lower_cpu_s=c1 - c0, compile_cpu_s=c2 - c1)


def _compile_times(learner, batch, args) -> dict:
    """Lowers and compiles, without running them, the learner's update step and the JAX
    sampler's decode chunk and prefill (--batch rows, a cache of --seq positions)."""
    from rl.rollout.jax_engine import JaxEngine
    from rl.rollout.jax_programs import LEN_BUCKETS, length_bucket

    out = {}
    add = lambda prefix, times: out.update({f"{prefix}_{k}": v for k, v in times.items()})
    add("learner", _compile("learner update", lambda: learner.lower_update(batch)))
    engine = JaxEngine(
        learner.model,
        max_batch=args.batch,
        chunk=args.decode_chunk,
        gemm_autotune=args.gemm_autotune,
    )
    try:
        C, S = engine.max_batch, length_bucket(args.seq, LEN_BUCKETS)
        add("decode", _compile("sampler decode chunk", lambda: engine.programs.lower_decode(C, S)))
        add("prefill", _compile("sampler prefill", lambda: engine.programs.lower_prefill(C, S)))
    finally:
        engine.close()
    return out


def _checkpoint_times(learner, batch) -> dict:
    """Checkpoints the learner state (params + Adam moments) synchronously, then asynchronously
    while three learner steps run; the async checkpoint is restored and checked against the
    state it was given (the steps donate the buffers it is writing)."""
    import shutil
    import tempfile

    from flax import nnx

    from rl.checkpoint import Checkpointer

    nbytes = sum(x.nbytes for x in jax.tree.leaves(learner.state))
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as root:
        sync = Checkpointer(os.path.join(root, "sync"), keep=1)
        t0 = time.perf_counter()
        sync.save(0, learner.state, {"version": 0})
        out["ckpt_sync_s"] = time.perf_counter() - t0
        sync.close()
        shutil.rmtree(sync.directory)  # one checkpoint on disk at a time
        saved = jax.tree.map(np.asarray, jax.device_get(nnx.to_pure_dict(learner.state)))
        ckpt = Checkpointer(os.path.join(root, "async"), keep=1, async_save=True)
        t0 = time.perf_counter()
        ckpt.save(1, learner.state, {"version": 1})
        out["ckpt_async_blocking_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(3):  # training goes on while the checkpoint is written
            learner.update(batch)
        jax.block_until_ready(learner.state)
        steps_s = time.perf_counter() - t1
        ckpt.wait()
        out["ckpt_async_total_s"] = time.perf_counter() - t0
        state, _, _ = ckpt.restore(learner.state)
        restored = jax.tree.map(np.asarray, jax.device_get(nnx.to_pure_dict(state)))
        ckpt.close()
    same = all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved))
    )
    print(
        f"checkpoint of {nbytes / 2**30:.2f} GiB (params + optimizer): sync "
        f"{out['ckpt_sync_s']:.2f} s; async: the learner waited "
        f"{out['ckpt_async_blocking_s']:.2f} s, then ran 3 steps ({steps_s:.2f} s) while it was "
        f"written, committed after {out['ckpt_async_total_s']:.2f} s; restored == saved: {same}"
    )
    if not same:
        raise RuntimeError("the async checkpoint does not hold the state it was given")
    return out


def _learner_breakdown(learner, batch, chunk: int, fl: LearnerFlops, step_s: float, peak):
    """Times the decoder body and the log-prob head (forward + backward) as separate programs."""
    from flax import nnx

    from rl.logprobs import token_logprobs

    arrays = dict(batch) if isinstance(batch, dict) else batch.arrays()
    arrays.pop("versions", None)
    b = jax.device_put(arrays, jax.devices()[0])
    model = learner.model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    cfg = model.config
    B, T = b["inputs"].shape
    kh, kg = jax.random.split(jax.random.key(1))
    g_BTD = jax.random.normal(kg, (B, T, cfg.hidden_size), cfg.dtype)
    h_BTD = jax.random.normal(kh, (B, T, cfg.hidden_size), cfg.dtype)
    w_DV = jax.block_until_ready(model.lm_head_kernel())

    def body_loss(p, b):  # the decoder layers' forward + backward, a linear read-out of h
        m = nnx.merge(graphdef, p, rest)
        h = m.hidden_states(b["inputs"], b["positions"], b.get("segment_ids"))
        return jnp.sum(h.astype(jnp.float32) * g_BTD)

    def head_loss(h, w, b):  # the log-prob head as the loss uses it (entropy without gradient)
        logp, ent = token_logprobs(h, w, b["targets"], 1.0, chunk)
        m = b["loss_mask"]
        return jnp.sum(logp * b["advantages"] * m), jnp.sum(jax.lax.stop_gradient(ent) * m)

    body = jax.jit(jax.grad(body_loss))
    head = jax.jit(jax.grad(head_loss, argnums=(0, 1), has_aux=True))
    D, V = cfg.hidden_size, cfg.vocab_size
    head_model = 6 * D * V
    parts = (
        ("decoder body", body, (params, b), fl.model - head_model),
        ("log-prob head", head, (h_BTD, w_DV, b), head_model),
    )
    rest_s = step_s
    for name, fn, fargs, flops in parts:
        timed(fn, *fargs)
        t = statistics.median(timed(fn, *fargs)[0] for _ in range(5))
        rest_s -= t
        rate = flops * B * T / t
        mfu = fmt(rate / peak) if peak else "n/a"
        print(f"  {name}: {t * 1e3:.1f} ms, {rate / 1e12:.1f} model TFLOP/s, MFU {mfu}")
    print(f"  rest (optimizer, loss, transfers): {rest_s * 1e3:.1f} ms")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench learner", description="Learner.update throughput and MFU"
    )
    add_model_arguments(p)
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--remat", default="full", choices=("full", "dots_saveable", "none"))
    p.add_argument("--chunk", type=int, help="log-prob vocab chunk; 0 = full logits; default auto")
    p.add_argument("--segments", default="mask", choices=("mask", "none"))
    p.add_argument("--devices", type=int, default=1, help="devices of the mesh (fsdp axis)")
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="processes the mesh spans (this one of them; docs/clusters.md: the environment)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--breakdown", action="store_true", help="also time body and head alone")
    p.add_argument(
        "--profile", action="store_true", help="also profile two steps: GPU kernel time by kind"
    )
    p.add_argument(
        "--checkpoint", action="store_true", help="also time a sync and an async checkpoint"
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="only lower and compile the update step and the sampler's decode chunk and prefill",
    )
    p.add_argument(
        "--decode-chunk", type=int, default=16, help="decode steps per chunk (--compile-only)"
    )
    p.add_argument(
        "--gemm-autotune",
        action="store_true",
        help="GPU: XLA's autotuned Triton GEMMs (trainer.gemm_autotune); default cuBLAS",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the learner benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(
        args,
        ("batch", "seq", "steps", "warmup", "devices", "hosts", "decode_chunk"),
        zero_ok=("warmup",),
    ):
        return 2
    print_result(bench_learner(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
