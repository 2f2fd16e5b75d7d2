"""python -m launch.bench NAME [options]: learner, sampler and device-ceiling benchmarks.

  learner   the real Learner.update (jit, donated state) on a synthetic RL batch (random tokens,
            the second half of each row trained, random advantages, ppo_clip): tokens/s, step
            time, model FLOPs per token and MFU against the datasheet bf16 peak.
  sampler   JaxEngine generating new tokens for a batch of random prompts (temperature 1):
            tokens/s end to end and for decoding alone, and the decode step against the memory
            roofline (bytes of weights + KV cache read per step / HBM bandwidth).
  ceilings  the measured bf16 matmul rate and device-to-device copy bandwidth of this device.

Each prints its figures, then one last line `RESULT name=value ...` (value "n/a" where the
device's peak is unknown, e.g. on CPU).

Model FLOPs per token (the PaLM convention, Chowdhery et al. 2022, appendix B):
  6 * N + 12 * L * T * (num_heads * head_dim)
with N the weights of every matmul: per layer q/k/v/o and gate/up/down, plus the LM head
(counted even when tied to the embedding). The embedding lookup, biases and norms are excluded;
attention is counted for the full T x T score matrix (not halved for causality; the halved
figure is printed as mfu_causal). Rematerialised work is not model FLOPs (see executed FLOPs).

Measured on one H200 (jax 0.11.2; its JAX 8192^3 bf16 matmul: 649 TFLOP/s), fp32 params + bf16
compute, cudnn attention, auto chunk, after the log-prob custom VJP (dc5795b):
  learner qwen2_0p5b 16x1024 remat=full (the trainer's path):     161 ms, 102k tok/s, MFU 0.33
  learner qwen2_0p5b 16x1024 remat=none --segments none:          137 ms, 120k tok/s, MFU 0.39
  learner qwen2_0p5b 32x1024 remat=none --segments none:          243 ms, 135k tok/s, MFU 0.44
  learner qwen2_1p5b 16x1024 remat=none --segments none:          322 ms,  51k tok/s, MFU 0.50
  sampler qwen2_0p5b 128 prompts x (128 + 256): 22.4k tok/s end to end, decode at 0.066 of the
  memory roofline (process_logits' full-vocabulary sort alone is 1.8 of the 4.4 ms step).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# Datasheet peaks: (dense bf16 FLOP/s, HBM bytes/s). The H200 is the H100 chip with more memory.
DEVICE_PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}
PRESETS = ("tiny", "qwen2_0p5b", "qwen2_1p5b")
CHUNK_TARGET = 16384  # auto log-prob chunk: the vocabulary in equal chunks of at most this


def device_peaks(kind: str) -> tuple[float | None, float | None]:
    """(bf16 dense FLOP/s, HBM bytes/s) of an SXM H100/H200 from its device_kind; else None."""
    if re.search(r"\bH200\b", kind):
        return DEVICE_PEAKS["H200"]
    if re.search(r"\bH100\b", kind) and not re.search(r"PCIe|NVL", kind, re.IGNORECASE):
        return DEVICE_PEAKS["H100"]
    return None, None


def model_config(preset: str, **fields):
    """The ModelConfig of a preset name with runtime fields (dtype, remat, ...) set."""
    import models

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is unknown; use one of {PRESETS}")
    return getattr(models, preset)(**fields)


def auto_chunk(vocab: int) -> int:
    """A log-prob chunk that splits the vocabulary into equal multiples of 128 near 16384."""
    n = -(-vocab // CHUNK_TARGET)
    return -(-vocab // n // 128) * 128 if n > 1 else vocab


# ---------------------------------------------------------------------------------------------
# FLOPs and bytes


@dataclasses.dataclass(frozen=True)
class LearnerFlops:
    """FLOPs per token of one training step (forward + backward)."""

    matmul_params: int  # N: layer matmul weights + LM head
    model: float  # 6 N + 12 L T q_dim
    model_causal: float  # 6 N + 6 L T q_dim (the causal half of the scores)
    executed: float  # estimate of what runs: model + recomputed forward work


def learner_flops(cfg, seq_len: int, *, remat: str = "none", chunk: int = 0) -> LearnerFlops:
    """Model and executed FLOPs per token of a train step over rows of seq_len tokens."""
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


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """Bytes read from device memory per decode step of the whole batch."""

    params: int  # every weight once (the embedding lookup reads only B rows when untied)
    kv_needed: float  # each row's valid cache positions, averaged over the decode steps
    kv_allocated: int  # the whole cache (what a dense masked attention reads)


def decode_bytes(cfg, batch: int, prompt_len: int, new_tokens: int, cache_len: int) -> DecodeBytes:
    """The fewest bytes a decode step must read (weights + KV cache) and the dense-cache bytes."""
    itemsize = jnp.dtype(cfg.param_dtype).itemsize
    untied_embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    params = (cfg.num_params - untied_embed) * itemsize
    per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    per_pos *= jnp.dtype(cfg.dtype).itemsize  # k and v of every layer, one position
    # Decode step i = 1 .. N-1 attends to prompt_len + i positions: mean prompt_len + N / 2.
    kv_needed = batch * per_pos * (prompt_len + new_tokens / 2)
    return DecodeBytes(params, float(kv_needed), batch * per_pos * cache_len)


# ---------------------------------------------------------------------------------------------
# Helpers


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, out


def _device_summary() -> tuple[str, float | None, float | None]:
    dev = jax.devices()[0]
    kind = dev.device_kind
    flops, bw = device_peaks(kind) if dev.platform == "gpu" else (None, None)
    print(f"device: {kind} ({dev.platform}, {jax.device_count()} devices), jax {jax.__version__}")
    return kind, flops, bw


def _peak_memory_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.6g}"


def _result(**values) -> str:
    line = "RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
    print(line)
    return line


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


def _default_attention() -> str:
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


# ---------------------------------------------------------------------------------------------
# Benchmarks


def bench_learner(args) -> dict:
    """Times Learner.update on a synthetic batch; prints and returns the figures."""
    from models import create_model, make_mesh
    from rl.learner import Learner, StepConfig, make_optimizer

    kind, peak_flops, _ = _device_summary()
    attention = args.attention or _default_attention()
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
    mesh = make_mesh(devices=jax.devices()[:1])
    t0 = time.perf_counter()
    model = create_model(cfg, mesh, seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    print(f"model init: {time.perf_counter() - t0:.1f} s ({cfg.num_params / 1e6:.1f} M params)")
    total = args.warmup + args.steps
    tx = make_optimizer(1e-6, total_steps=total)
    learner = Learner(model, tx, mesh=mesh, step_cfg=StepConfig(logprob_chunk=chunk))
    batch = synthetic_batch(cfg.vocab_size, B, T, seed=args.seed)
    if args.segments == "none":  # rows are unpacked: drop the segment mask
        batch = {k: v for k, v in batch.arrays().items() if k != "segment_ids"}
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
    timed = times[args.warmup :]
    step_s = statistics.median(timed)
    tokens = B * T
    fl = learner_flops(cfg, T, remat=cfg.remat, chunk=chunk)
    flops_s = fl.model * tokens / step_s
    mfu = flops_s / peak_flops if peak_flops else None
    mfu_causal = fl.model_causal * tokens / step_s / peak_flops if peak_flops else None
    hfu = fl.executed * tokens / step_s / peak_flops if peak_flops else None
    print(
        f"step: median {step_s * 1e3:.1f} ms over {len(timed)} steps "
        f"(min {min(timed) * 1e3:.1f}, max {max(timed) * 1e3:.1f})"
    )
    print(f"tokens/s: {tokens / step_s:,.0f} ({tokens // 2:,} of {tokens:,} tokens trained)")
    print(
        f"model FLOPs/token: {fl.model / 1e9:.3f} G = 6 * {fl.matmul_params / 1e6:.1f} M "
        f"+ 12 * L * T * q_dim; executed (with recompute) ~{fl.executed / 1e9:.3f} G"
    )
    print(f"model TFLOP/s: {flops_s / 1e12:.1f}; peak: {_fmt(peak_flops and peak_flops / 1e12)}")
    print(f"MFU: {_fmt(mfu)}  (causal-halved attention: {_fmt(mfu_causal)}; HFU ~{_fmt(hfu)})")
    mem = _peak_memory_gib()
    if mem is not None:
        print(f"peak device memory: {mem:.1f} GiB")
    if args.breakdown:
        _learner_breakdown(learner, batch, chunk, fl, step_s, peak_flops)
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

    arrays = batch.arrays() if hasattr(batch, "arrays") else dict(batch)
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
        _timed(fn, *fargs)
        t = statistics.median(_timed(fn, *fargs)[0] for _ in range(5))
        rest_s -= t
        rate = flops * B * T / t
        mfu = _fmt(rate / peak) if peak else "n/a"
        print(f"  {name}: {t * 1e3:.1f} ms, {rate / 1e12:.1f} model TFLOP/s, MFU {mfu}")
    print(f"  rest (optimizer, loss, transfers): {rest_s * 1e3:.1f} ms")


def bench_sampler(args) -> dict:
    """Times JaxEngine.generate on random prompts; prints and returns the figures."""
    from models import create_model, make_mesh
    from rl.rollout import jax_engine as je
    from rl.rollout.base import GenerationRequest, SamplingParams

    kind, _, bw = _device_summary()
    attention = args.attention or _default_attention()
    cfg = model_config(
        args.preset, dtype=args.dtype, param_dtype=args.dtype, attention_impl=attention
    )
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    if N < 2:
        raise ValueError(f"--new-tokens={N} must be >= 2 (decode time = full - prefill-only)")
    print(f"sampler: {args.preset} {cfg.dtype} attention={attention} batch={B} prompt={P} new={N}")
    model = create_model(cfg, make_mesh(devices=jax.devices()[:1]), seed=0)
    engine = je.JaxEngine(model, max_batch=B)
    del model
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, P).astype(np.int32) for _ in range(B)]

    def run(new: int, rep: int) -> float:
        reqs = [
            GenerationRequest(f"{rep}-{i}", p, SamplingParams(max_new_tokens=new, seed=rep * B + i))
            for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        gens = engine.generate(reqs)
        dt = time.perf_counter() - t0
        for g in gens:
            if len(g.token_ids) != new or not np.all(np.isfinite(g.logprobs)):
                raise RuntimeError(
                    f"request {g.request_id}: {len(g.token_ids)} tokens (want {new}), "
                    f"finite logprobs: {bool(np.all(np.isfinite(g.logprobs)))}"
                )
        return dt

    t0 = time.perf_counter()
    run(N, 1000), run(1, 1001)
    print(f"warmup (compiles): {time.perf_counter() - t0:.1f} s")
    full = statistics.median(run(N, r) for r in range(args.repeats))
    prefill = statistics.median(run(1, r) for r in range(args.repeats))
    decode_s = max(full - prefill, 1e-9)
    step_s = decode_s / (N - 1)
    print(f"generate {B}x{N}: {full * 1e3:.1f} ms; prefill only (1 new token): {prefill * 1e3:.1f}")
    print(f"tokens/s: {B * N / full:,.0f} end to end; decode only: {B * (N - 1) / decode_s:,.0f}")
    print(f"decode step: {step_s * 1e3:.3f} ms")
    cache_len = je._bucket(P, je.LEN_BUCKETS) + je._bucket(N, je.LEN_BUCKETS)
    nb = decode_bytes(cfg, B, P, N, cache_len)
    floor_s = (nb.params + nb.kv_needed) / bw if bw else None
    frac = floor_s / step_s if floor_s else None
    print(
        f"bytes/step: params {nb.params / 1e9:.3f} GB + KV needed {nb.kv_needed / 1e9:.3f} GB "
        f"(dense cache allocated: {nb.kv_allocated / 1e9:.3f} GB)"
    )
    print(f"roofline step: {_fmt(floor_s and floor_s * 1e3)} ms at {_fmt(bw and bw / 1e12)} TB/s;")
    print(f"  fraction achieved: {_fmt(frac)}")
    # The per-step sampling transform (temperature, top-k / top-p with a full-vocabulary sort).
    logits = jax.random.normal(jax.random.key(0), (B, cfg.vocab_size), jnp.float32)
    proc = jax.jit(je.process_logits)
    pargs = (logits, jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B))
    _timed(proc, *pargs)
    proc_s = statistics.median(_timed(proc, *pargs)[0] for _ in range(10))
    print(f"process_logits alone [{B}, {cfg.vocab_size}]: {proc_s * 1e3:.3f} ms per call")
    mem = _peak_memory_gib()
    if mem is not None:
        print(f"peak device memory: {mem:.1f} GiB")
    return dict(
        sampler_tokens_per_s=B * N / full,
        decode_tokens_per_s=B * (N - 1) / decode_s,
        roofline_frac=frac,
        decode_step_s=step_s,
    )


def bench_ceilings(args) -> dict:
    """Measures the bf16 matmul rate and the copy bandwidth of the first device."""
    _device_summary()
    n = args.matmul_size
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    _timed(mm, a, b)
    mm_s = statistics.median(_timed(mm, a, b)[0] for _ in range(args.repeats))
    x = jax.random.normal(ka, (args.copy_mib * 2**20 // 2,), jnp.bfloat16)
    cp = jax.jit(lambda x: x + 1)  # reads and writes every element once
    _timed(cp, x)
    cp_s = statistics.median(_timed(cp, x)[0] for _ in range(args.repeats))
    tflops = 2 * n**3 / mm_s / 1e12
    tb_s = 2 * x.nbytes / cp_s / 1e12
    print(f"bf16 matmul {n}^3: {mm_s * 1e3:.2f} ms = {tflops:.1f} TFLOP/s")
    print(f"copy {x.nbytes / 2**20:.0f} MiB (read + write): {cp_s * 1e3:.2f} ms = {tb_s:.2f} TB/s")
    return dict(matmul_tflops=tflops, copy_tb_s=tb_s)


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="name", required=True)

    def common(s, preset="qwen2_0p5b"):
        s.add_argument("--preset", default=preset, choices=PRESETS)
        s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
        s.add_argument("--attention", choices=("cudnn", "xla"), help="default: cudnn on GPU")
        s.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("learner", help="Learner.update throughput and MFU")
    common(s)
    s.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--seq", type=int, default=1024)
    s.add_argument("--remat", default="full", choices=("full", "dots_saveable", "none"))
    s.add_argument("--chunk", type=int, help="log-prob vocab chunk; 0 = full logits; default auto")
    s.add_argument("--segments", default="mask", choices=("mask", "none"))
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--steps", type=int, default=5)
    s.add_argument("--breakdown", action="store_true", help="also time body and head alone")
    s.add_argument(
        "--checkpoint", action="store_true", help="also time a sync and an async checkpoint"
    )

    s = sub.add_parser("sampler", help="JaxEngine decode throughput and memory roofline")
    common(s)
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--new-tokens", type=int, default=256)
    s.add_argument("--repeats", type=int, default=2)

    s = sub.add_parser("ceilings", help="measured bf16 matmul rate and copy bandwidth")
    s.add_argument("--matmul-size", type=int, default=8192)
    s.add_argument("--copy-mib", type=int, default=2048)
    s.add_argument("--repeats", type=int, default=10)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one benchmark and prints its RESULT line last."""
    if (argv := sys.argv[1:] if argv is None else argv)[:1] == ["async"]:  # sync vs async trainer
        from launch.bench_async import main as bench_async

        return bench_async(argv[1:])
    if argv[:1] == ["publish"]:  # parameter server vs a plain copy (launch/bench_publish.py)
        from launch.bench_publish import main as bench_publish

        return bench_publish(argv[1:])
    args = _parser().parse_args(argv)
    for name in ("batch", "seq", "prompt_len", "steps", "repeats", "warmup"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "warmup" else 1):
            print(f"--{name.replace('_', '-')}={value} must be positive", file=sys.stderr)
            return 2
    run = {"learner": bench_learner, "sampler": bench_sampler, "ceilings": bench_ceilings}
    _result(**run[args.name](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
