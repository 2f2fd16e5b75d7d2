"""python -m launch.bench sampler: the JAX sampler decoding a batch of random prompts, its
tokens/s and its decode step against the memory roofline (weights + KV cache read per step);
with --workload longtail (Pareto budgets, more requests than slots) static against continuous
batching, and with --vllm a vLLM host on the same model and requests, all in one run."""

from __future__ import annotations

import argparse
import dataclasses
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
    from rl.rollout import sample_kernel
    from rl.rollout.base import GenerationRequest, SamplingParams
    from rl.rollout.jax_engine import JaxEngine
    from rl.rollout.jax_programs import LEN_BUCKETS, length_bucket
    from rl.rollout.sampling import process_logits, sample

    kind, _, bw = device_summary()
    attention = args.attention or default_attention()
    cfg = model_config(
        args.preset, dtype=args.dtype, param_dtype=args.dtype, attention_impl=attention
    )
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    if N < 2:
        raise ValueError(f"--new-tokens={N} must be >= 2 (decode time = full - prefill-only)")
    print(
        f"sampler: {args.preset} {cfg.dtype} attention={attention} batch={B} prompt={P} new={N} "
        f"decode attention: {args.decode_attention}, sample kernel: {args.sample_kernel}"
    )
    model = create_model(cfg, make_mesh(devices=jax.devices()[:1]), seed=0)
    engine = JaxEngine(
        model,
        max_batch=B,
        decode_attention=args.decode_attention,
        sample_kernel={"auto": None, "on": True, "off": False}[args.sample_kernel],
        gemm_autotune=args.gemm_autotune,
    )
    del model
    print(
        f"engine: decode attention {engine.decode_attention}, sample kernel "
        f"{engine.sample_kernel}, norms folded into the kernels {engine.fold_norms}"
    )
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, P).astype(np.int32) for _ in range(B)]

    def run(new: int, rep: int) -> tuple[float, int]:
        """(seconds, decode steps the engine ran) of one generate."""
        reqs = [
            GenerationRequest(f"{rep}-{i}", p, SamplingParams(max_new_tokens=new, seed=rep * B + i))
            for i, p in enumerate(prompts)
        ]
        steps0, t0 = engine.decode_steps, time.perf_counter()
        gens = engine.generate(reqs)
        dt = time.perf_counter() - t0
        steps = engine.decode_steps - steps0
        for g in gens:
            if len(g.token_ids) != new or not np.all(np.isfinite(g.logprobs)):
                raise RuntimeError(
                    f"request {g.request_id}: {len(g.token_ids)} tokens (want {new}), "
                    f"finite logprobs: {bool(np.all(np.isfinite(g.logprobs)))}"
                )
        return dt, steps

    t0 = time.perf_counter()
    run(N, 1000), run(1, 1001)
    print(f"warmup (compiles): {time.perf_counter() - t0:.1f} s")
    fulls, full_steps = zip(*(run(N, r) for r in range(args.repeats)))
    prefills, prefill_steps = zip(*(run(1, r) for r in range(args.repeats)))
    full_steps, prefill_steps = sorted(set(full_steps)), sorted(set(prefill_steps))
    prefill = statistics.median(prefills)
    if len(full_steps) != 1 or len(prefill_steps) != 1 or full_steps[0] <= prefill_steps[0]:
        raise RuntimeError(f"decode steps per run: {full_steps} (full), {prefill_steps} (prefill)")
    # The step: the time between the two runs over the decode steps between them (a chunk runs
    # whole, so that can be more than the N - 1 tokens decoded).
    n_steps = full_steps[0] - prefill_steps[0]
    full = statistics.median(fulls)
    decode_s = max(full - prefill, 1e-9)
    step_s = decode_s / n_steps
    print(f"generate {B}x{N}: {full * 1e3:.1f} ms; prefill only (1 new token): {prefill * 1e3:.1f}")
    print(f"tokens/s: {B * N / full:,.0f} end to end; decode only: {B * (N - 1) / decode_s:,.0f}")
    print(f"decode steps run: {full_steps[0]} (generate), {prefill_steps[0]} (prefill only)")
    per = [(f - prefill) / n_steps * 1e3 for f in fulls]  # the spread a comparison must beat
    spread = f" (repeats {min(per):.3f}-{max(per):.3f})" if len(per) > 1 else ""
    print(f"decode step: {step_s * 1e3:.3f} ms{spread}")
    cache_len = length_bucket(P + N - 1, LEN_BUCKETS)  # the cache at the last step
    nb = decode_bytes(cfg, B, P, N, cache_len)
    floor_s = (nb.params + nb.kv_needed) / bw if bw else None
    frac = floor_s / step_s if floor_s else None
    print(
        f"bytes/step: params {nb.params / 1e9:.3f} GB + KV needed {nb.kv_needed / 1e9:.3f} GB "
        f"(dense cache allocated: {nb.kv_allocated / 1e9:.3f} GB)"
    )
    print(f"roofline step: {fmt(floor_s and floor_s * 1e3)} ms at {fmt(bw and bw / 1e12)} TB/s;")
    print(f"  fraction achieved: {fmt(frac)}")
    # A decode step's sampling as the engine runs it at temperature 1 (no top-k / top-p).
    logits = jax.random.normal(jax.random.key(0), (B, cfg.vocab_size), jnp.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), B))

    def draw(x, t, k, p, keys):
        return sample(process_logits(x, t, k, p, truncate=False), keys, t)

    proc = jax.jit(draw)
    pargs = (logits, jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B), keys)
    timed(proc, *pargs)
    proc_s = statistics.median(timed(proc, *pargs)[0] for _ in range(10))
    line = f"sampling alone [{B}, {cfg.vocab_size}]: XLA {proc_s * 1e3:.3f} ms per step"
    if engine.sample_kernel and jax.devices()[0].platform == "gpu":  # what the engine runs
        kern = jax.jit(sample_kernel.sample)
        timed(kern, logits, keys, jnp.ones(B))
        kern_s = statistics.median(timed(kern, logits, keys, jnp.ones(B))[0] for _ in range(10))
        line += f"; the Pallas kernels (the engine's) {kern_s * 1e3:.3f} ms"
    print(line)
    if args.profile:  # one generate of N tokens; kernel time per generated token (decode step)
        kernel_profile(lambda: run(N, 2000), lambda: jnp.zeros(()), steps=1, per=N, unit="token")
    mem = peak_memory_gib()
    if mem is not None:
        print(f"peak device memory: {mem:.1f} GiB")
    return dict(
        sampler_tokens_per_s=B * N / full,
        decode_tokens_per_s=B * (N - 1) / decode_s,
        roofline_frac=frac,
        decode_step_s=step_s,
    )


def workload(args, vocab: int) -> list:
    """The requests of --workload: random prompts, budgets --new-tokens (uniform) or
    Pareto(--alpha) in [--min-tokens, --new-tokens] (longtail); no stop token, temperature 1."""
    import random

    from rl.rollout.base import GenerationRequest, SamplingParams
    from rl.tasks.longtail import pareto_budget

    n = args.requests or (args.batch if args.workload == "uniform" else 8 * args.batch)
    rng = np.random.default_rng(args.seed)
    budgets = random.Random(args.seed)
    reqs = []
    for i in range(n):
        new = args.new_tokens
        if args.workload == "longtail":
            new = pareto_budget(budgets, args.alpha, args.min_tokens, args.new_tokens)
        prompt = rng.integers(3, vocab, args.prompt_len).astype(np.int32)
        reqs.append(GenerationRequest(f"w{i}", prompt, SamplingParams(max_new_tokens=new, seed=i)))
    return reqs


def _timed_workload(engine, reqs, repeats: int) -> tuple[float, int]:
    """(median seconds, tokens) of generating every request at once, after one warm-up pass."""
    import dataclasses as dc

    def once(tag: str) -> tuple[float, int]:
        batch = [dc.replace(r, request_id=f"{tag}-{r.request_id}") for r in reqs]
        t0 = time.perf_counter()
        gens = engine.generate(batch)
        dt = time.perf_counter() - t0
        for g, r in zip(gens, reqs):
            if len(g.token_ids) != r.params.max_new_tokens or g.finish_reason != "length":
                raise RuntimeError(
                    f"request {g.request_id}: {len(g.token_ids)} tokens ({g.finish_reason}), "
                    f"want {r.params.max_new_tokens}"
                )
        return dt, sum(len(g.token_ids) for g in gens)

    once("warm")
    runs = [once(f"r{i}") for i in range(repeats)]
    return statistics.median(dt for dt, _ in runs), runs[0][1]


def bench_workload(args) -> dict:
    """Useful tokens/s of one request set on the JAX sampler (static and continuous batching
    with --workload longtail) and, with --vllm, on a vLLM host serving the same weights."""
    import tempfile

    from models import create_model, make_mesh
    from rl.rollout.jax_engine import JaxEngine

    device_summary()
    cfg = model_config(args.preset, dtype=args.dtype, param_dtype=args.dtype)
    model = create_model(cfg, make_mesh(devices=jax.devices()[:1]), seed=args.seed)
    reqs = workload(args, cfg.vocab_size)
    lens = [r.params.max_new_tokens for r in reqs]
    print(
        f"workload {args.workload}: {len(reqs)} requests, prompt {args.prompt_len}, new tokens "
        f"mean {statistics.mean(lens):.1f} max {max(lens)}; {args.batch} slots; {cfg.dtype}",
        flush=True,
    )
    out: dict = {}
    modes = ("static", "continuous") if args.workload == "longtail" else ("continuous",)
    for mode in modes:
        engine = JaxEngine(model, max_batch=args.batch, continuous=mode == "continuous")
        dt, tokens = _timed_workload(engine, reqs, args.repeats)
        occ = engine.stats()["slot_occupancy"]
        engine.close()
        out[f"{mode}_tok_s"], out[f"{mode}_occupancy"] = tokens / dt, occ
        print(
            f"jax {mode:10s}: {dt:7.2f} s, {tokens / dt:10,.0f} useful tok/s, slot occupancy "
            f"{occ:.1%}",
            flush=True,
        )
    if "static_tok_s" in out:
        out["continuous_over_static"] = out["continuous_tok_s"] / out["static_tok_s"]
        print(f"continuous / static: {out['continuous_over_static']:.2f}x", flush=True)
    if args.vllm:
        from models import save_hf
        from models.tokenizer import build_task_tokenizer
        from rl.rollout.vllm import VLLMEngine
        from rl.rollout.vllm_host import VLLMHost

        with tempfile.TemporaryDirectory(prefix="bench-sampler-") as root:
            tok_dir = build_task_tokenizer(os.path.join(root, "tokenizer"))
            path = os.path.join(root, "model")
            save_hf(model, path, tokenizer_dir=tok_dir)
            max_len = args.prompt_len + args.new_tokens
            host = VLLMHost.launch(
                path,
                log_path=os.path.join(root, "vllm.log"),
                dtype=cfg.dtype,
                max_model_len=max_len,
                extra_args=["--max-num-seqs", str(args.batch)],
            )
            try:
                host.wait_ready(args.vllm_ready_s)
            except BaseException:
                host.stop()
                raise
            engine = VLLMEngine(
                [host], version=0, owns_hosts=True, max_concurrency=min(len(reqs), 2 * args.batch)
            )
            try:
                dt, tokens = _timed_workload(engine, reqs, args.repeats)
            finally:
                engine.close()
        out["vllm_tok_s"] = tokens / dt
        jax_tok_s = out["continuous_tok_s"]
        out["jax_over_vllm"] = jax_tok_s / out["vllm_tok_s"]
        print(f"vllm           : {dt:7.2f} s, {tokens / dt:10,.0f} useful tok/s", flush=True)
        print(f"jax (continuous) / vllm: {out['jax_over_vllm']:.2f}x", flush=True)
    return out


def _decode_attention_choices() -> tuple[str, ...]:
    from rl.rollout.jax_programs import DECODE_ATTENTION

    return DECODE_ATTENTION


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
    p.add_argument(
        "--workload",
        choices=("roofline", "uniform", "longtail"),
        default="roofline",
        help="roofline: one batch, decode step vs memory roofline; uniform / longtail: a request "
        "set's useful tokens/s (longtail: static vs continuous batching)",
    )
    p.add_argument(
        "--requests", type=int, default=0, help="0: batch (uniform), 4 x batch (longtail)"
    )
    p.add_argument("--min-tokens", type=int, default=16, help="longtail: shortest budget")
    p.add_argument("--alpha", type=float, default=1.0, help="longtail: Pareto tail index")
    p.add_argument("--vllm", action="store_true", help="also a vLLM host on the same requests")
    p.add_argument("--vllm-ready-s", type=float, default=600.0, help="vLLM startup deadline")
    p.add_argument(
        "--decode-attention",
        choices=_decode_attention_choices(),
        default="auto",
        help="roofline: the decode step's attention (auto: the Pallas kernel on one GPU)",
    )
    p.add_argument(
        "--decode-splits",
        type=int,
        default=0,
        help="programs per row and kv head in the Pallas decode attention (0: its default)",
    )
    p.add_argument(
        "--sample-kernel",
        choices=("auto", "on", "off"),
        default="auto",
        help="roofline: sampling as Pallas kernels (auto: with the Pallas decode attention)",
    )
    p.add_argument(
        "--profile", action="store_true", help="roofline: GPU kernel time per decode step by kind"
    )
    p.add_argument(
        "--gemm-autotune",
        action="store_true",
        help="GPU: XLA's autotuned GEMMs (trainer.gemm_autotune); default cuBLAS",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the sampler benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("batch", "prompt_len", "repeats", "min_tokens")):
        return 2
    if args.decode_splits < 0:
        print(f"--decode-splits={args.decode_splits}: must be >= 0", file=sys.stderr)
        return 2
    if args.decode_splits:
        from models import decode_attention

        decode_attention.SPLITS = args.decode_splits
    if args.workload == "roofline" and args.vllm:
        print("--vllm needs --workload uniform or longtail", file=sys.stderr)
        return 2
    if args.workload != "roofline" and args.profile:
        print("--profile needs --workload roofline", file=sys.stderr)
        return 2
    print_result(bench_sampler(args) if args.workload == "roofline" else bench_workload(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
