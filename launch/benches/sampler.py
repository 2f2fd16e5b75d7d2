"""python -m launch.bench sampler: the JAX sampler decoding a batch of random prompts, its
tokens/s and its decode step against the memory roofline (weights + KV cache read per step)."""

from __future__ import annotations

import argparse
import dataclasses
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
    model_config,
    peak_memory_gib,
    print_result,
    reject_nonpositive,
    timed,
)


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


def bench_sampler(args) -> dict:
    """Times JaxEngine.generate on random prompts (temperature 1); prints and returns the
    figures: tokens/s end to end and for decoding alone, the decode step against its roofline."""
    from models import create_model, make_mesh
    from rl.rollout import jax_engine as je
    from rl.rollout.base import GenerationRequest, SamplingParams

    kind, _, bw = device_summary()
    attention = args.attention or default_attention()
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
    cache_len = je.length_bucket(P, je.LEN_BUCKETS) + je.length_bucket(N, je.LEN_BUCKETS)
    nb = decode_bytes(cfg, B, P, N, cache_len)
    floor_s = (nb.params + nb.kv_needed) / bw if bw else None
    frac = floor_s / step_s if floor_s else None
    print(
        f"bytes/step: params {nb.params / 1e9:.3f} GB + KV needed {nb.kv_needed / 1e9:.3f} GB "
        f"(dense cache allocated: {nb.kv_allocated / 1e9:.3f} GB)"
    )
    print(f"roofline step: {fmt(floor_s and floor_s * 1e3)} ms at {fmt(bw and bw / 1e12)} TB/s;")
    print(f"  fraction achieved: {fmt(frac)}")
    # The per-step sampling transform (temperature, top-k / top-p with a full-vocabulary sort).
    logits = jax.random.normal(jax.random.key(0), (B, cfg.vocab_size), jnp.float32)
    proc = jax.jit(je.process_logits)
    pargs = (logits, jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B))
    timed(proc, *pargs)
    proc_s = statistics.median(timed(proc, *pargs)[0] for _ in range(10))
    print(f"process_logits alone [{B}, {cfg.vocab_size}]: {proc_s * 1e3:.3f} ms per call")
    mem = peak_memory_gib()
    if mem is not None:
        print(f"peak device memory: {mem:.1f} GiB")
    return dict(
        sampler_tokens_per_s=B * N / full,
        decode_tokens_per_s=B * (N - 1) / decode_s,
        roofline_frac=frac,
        decode_step_s=step_s,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench sampler",
        description="JaxEngine decode throughput and memory roofline",
    )
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the sampler benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("batch", "prompt_len", "repeats")):
        return 2
    print_result(bench_sampler(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
