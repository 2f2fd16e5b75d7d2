"""python -m launch.bench attention: one decode step's attention as the model's decode runs it,
the Pallas kernel (models.decode_attention_qkv, keys [B, K, S, H]; rotary and the q/k/v split in
it, as for the presets' Qwen2 shapes) against XLA's path (the split, rotary, the slot writes,
then models.kv_cache.xla_decode_attention over the whole cache, keys [B, K, H, S]), at a model's
shapes for cached lengths of a few blocks; each timed over distinct layers' caches, so that
HBM, not L2, serves them; --blocks/--warps/--stages/--splits sweep the kernel's launch
constants. On a GPU the times are the profiler's kernel times; elsewhere wall
clock (the kernel interpreted: a check that it runs, not a speed)."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from launch.benches.common import (
    PRESETS,
    device_summary,
    fmt,
    gpu_kernel_times,
    model_config,
    print_result,
    reject_nonpositive,
)
from models import decode_attention as da
from models.kv_cache import write_slot, xla_decode_attention
from models.transformer import apply_rotary, rotary


def _data(cfg, B, S, layers, position, seed):
    """(inputs, caches with keys [B, K, S, H], a copy with keys [B, K, H, S]): the fused
    projection's output qkv [B, N + 2K, H], rotary's (cos, sin) [B, H] and the positions, every
    row at `position`; `layers` distinct caches."""
    K, N, H = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    keys = iter(jax.random.split(jax.random.key(seed), 1 + 2 * layers))
    arr = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(cfg.dtype)
    qkv = arr(B, N + 2 * K, H)
    k_sh = [arr(B, K, S, H) for _ in range(layers)]
    v = [arr(B, K, S, H) for _ in range(layers)]
    k_hs = [jnp.swapaxes(k, 2, 3) for k in k_sh]  # the same keys, positions minor
    pos = jnp.full((B,), position, jnp.int32)
    cos, sin = (r.reshape(B, H) for r in rotary(cfg, pos[:, None]))  # [B, 1, 1, H] each
    # Each path donates its caches, so the XLA path gets its own copy of the values.
    return (qkv, (cos, sin), pos), (k_sh, v), (k_hs, [jnp.copy(x) for x in v])


def _split_rotated(cfg, qkv, rope):
    """q [B, N, H], k and v [B, K, H] of the fused projection's output, rotary on q and k."""
    N, K = cfg.num_attention_heads, cfg.num_key_value_heads
    q, k, v = qkv[:, :N], qkv[:, N : N + K], qkv[:, N + K :]
    cos, sin = (r[:, None, None] for r in rope)  # [B, 1, 1, H], as models.transformer.rotary
    q, k = (apply_rotary(x[:, None], cos, sin)[:, 0] for x in (q, k))
    return q, k, v


def _pallas(cfg, qkv, rope, pos):
    """The kernel over every layer's cache as the model's decode calls it for the presets
    (Qwen2: no q/k norms, so rotary and the q/k/v split in the kernel), traced with the
    module's launch constants."""
    N = cfg.num_attention_heads
    interpret = jax.default_backend() != "gpu"

    def run(ks, vs):
        call = partial(da.decode_attention_qkv, qkv, rope, num_heads=N, k_pos=2)
        out = [call(k, v, pos, interpret=interpret) for k, v in zip(ks, vs)]
        return [o for o, _, _ in out], [k for _, k, _ in out], [v for _, _, v in out]

    return jax.jit(run, donate_argnums=(0, 1))  # the caches updated in place, as in the engine


def _xla(cfg, qkv, rope, pos):
    """XLA's path: the split and rotary, the slot writes, then attention over the whole cache,
    every layer."""

    def run(ks, vs):
        q, kn, vn = _split_rotated(cfg, qkv, rope)
        valid = jnp.arange(vs[0].shape[2])[None, :] <= pos[:, None]
        ks = [write_slot(k, kn, pos, 3) for k in ks]
        vs = [write_slot(v, vn, pos, 2) for v in vs]
        return [xla_decode_attention(q, k, v, valid, 3) for k, v in zip(ks, vs)], ks, vs

    return jax.jit(run, donate_argnums=(0, 1))


def _time(fn, caches, calls: int) -> tuple[float, np.ndarray, tuple]:
    """(us a layer, the first call's outputs, the caches after): profiler kernel time on a
    GPU, else wall clock."""
    layers = len(caches[0])
    out = fn(*caches)  # compiles
    state = {"caches": out[1:]}
    first = np.stack([np.asarray(o, np.float32) for o in out[0]])

    def run():
        state["caches"] = fn(*state["caches"])[1:]

    jax.block_until_ready(state["caches"])
    if jax.default_backend() == "gpu":
        kernels = gpu_kernel_times(run, lambda: state["caches"], calls)
        us = sum(ms for _, ms in kernels.values()) * 1e3 / (calls * layers)
    else:
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        jax.block_until_ready(state["caches"])
        us = (time.perf_counter() - t0) * 1e6 / (calls * layers)
    return us, first, state["caches"]


def _configs(args) -> list[tuple[int, int, int, int]]:
    """(block, warps, stages, splits) to time: the product of the lists given, the module's
    constants where a list is not; the default first."""
    default = (da.BLOCK_S[0], da.WARPS, da.STAGES, da.SPLITS)
    lists = [args.blocks, args.warps, args.stages, args.splits]
    grid = itertools.product(*[v or [d] for v, d in zip(lists, default)])
    return [default] + [c for c in grid if c != default]


def bench_attention(args) -> dict:
    _, _, bw = device_summary()
    gpu = jax.default_backend() == "gpu"
    cfg = model_config(args.preset, dtype=args.dtype, param_dtype=args.dtype)
    B, K, N, H = args.batch, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    S, L = args.cache_len, args.layers or cfg.num_hidden_layers
    positions = sorted(set(args.positions))
    bad = [p for p in positions if not 0 <= p < S]
    if bad:
        raise ValueError(f"--positions {bad}: each must be in [0, --cache-len={S})")
    if not da.supported(cfg.dtype, N, K, H, S):
        raise ValueError(
            f"the Pallas decode attention does not take {args.preset} ({cfg.dtype}, {N} heads, "
            f"{K} kv heads, head dim {H}) with --cache-len={S} (see decode_attention.supported)"
        )
    bad = [b for b in args.blocks or () if b < 16 or b & (b - 1) or S % b]
    if bad:
        raise ValueError(f"--blocks {bad}: each a power of two >= 16 that divides {S}")
    configs = _configs(args)
    print(
        f"attention: {args.preset} {cfg.dtype} batch={B} kv heads={K} query heads={N} "
        f"head dim={H} cache={S} layers={L}; {'kernel' if gpu else 'wall'} time a layer"
    )
    item = jnp.dtype(cfg.dtype).itemsize
    saved = (da.BLOCK_S, da.WARPS, da.STAGES, da.SPLITS)
    times = {c: [] for c in configs}
    diffs = {c: 0.0 for c in configs}  # each setting's outputs against XLA's
    result, ratios = {}, []
    try:
        for p in positions:
            args_p, kv_sh, kv_hs = _data(cfg, B, S, L, p, args.seed)
            # As the model: float32 means float32 (no TF32 in XLA's path either).
            with jax.default_matmul_precision(cfg.precision):
                t_xla, o_xla, _ = _time(_xla(cfg, *args_p), kv_hs, args.calls)
                for c in configs:
                    da.BLOCK_S = (c[0],) + saved[0]
                    da.WARPS, da.STAGES, da.SPLITS = c[1:]
                    t, o, kv_sh = _time(_pallas(cfg, *args_p), kv_sh, args.calls)
                    d = float(np.abs(o - o_xla).max())  # the same inputs: one rounding apart
                    times[c].append(t)
                    diffs[c] = max(diffs[c], d)
                    if c == configs[0]:
                        t_pallas, diff = t, d
            need = 2 * B * K * p * H * item  # the valid slots' keys and values, once
            rate = need / (t_pallas * 1e-6)
            frac = f", {rate / bw:.1%} of the bandwidth" if bw else ""
            ratios.append(t_xla / t_pallas)
            print(
                f"position {p:5d}: kernel {t_pallas:7.2f} us, XLA {t_xla:7.2f} us "
                f"({t_xla / t_pallas:.2f}x); {need / 1e6:.2f} MB of cache at "
                f"{rate / 1e12:.2f} TB/s{frac}; outputs {diff:.2g} apart"
            )
            result[f"kernel_us_p{p}"] = t_pallas
            result[f"xla_us_p{p}"] = t_xla
            result[f"max_diff_p{p}"] = diff
    finally:
        da.BLOCK_S, da.WARPS, da.STAGES, da.SPLITS = saved
    result["speedup_geomean"] = float(np.exp(np.mean(np.log(ratios))))
    print(f"kernel against XLA: {fmt(result['speedup_geomean'], 3)}x (geometric mean)")
    if len(configs) > 1:
        mean = {c: float(np.mean(t)) for c, t in times.items()}
        print(
            "block, warps, stages, splits: us a layer at each position; mean; against the default"
        )
        for c in sorted(configs, key=mean.get):
            each = ", ".join(f"{t:.2f}" for t in times[c])
            tag = "  (the default)" if c == configs[0] else ""
            ratio = mean[configs[0]] / mean[c]
            print(f"  {c}: {each}; {mean[c]:.2f}; {ratio:.3f}x; {diffs[c]:.2g} apart{tag}")
        best = min(configs, key=mean.get)
        result["best_speedup_over_default"] = mean[configs[0]] / mean[best]
        result["sweep_max_diff"] = max(diffs.values())
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.bench attention", description=__doc__)
    p.add_argument("--preset", default="qwen2_0p5b", choices=PRESETS)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch", type=int, default=128, help="rows, each its own cache")
    p.add_argument("--cache-len", type=int, default=512, help="allocated slots a row")
    p.add_argument(
        "--positions",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[64, 128, 256, 448],
        help="comma-separated cached lengths (every row at one per measurement)",
    )
    p.add_argument("--layers", type=int, default=0, help="distinct caches (0: the model's layers)")
    p.add_argument("--calls", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--seed", type=int, default=0)
    ints = lambda s: [int(x) for x in s.split(",")]
    for name, what in (
        ("blocks", "cache slots per inner step"),
        ("warps", "Triton warps"),
        ("stages", "Triton pipeline stages"),
        ("splits", "programs per row and kv head (split-KV)"),
    ):
        p.add_argument(
            f"--{name}",
            type=ints,
            default=None,
            help=f"comma-separated {what} to sweep (default: the kernel's own)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the attention benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("batch", "cache_len", "calls"), zero_ok=("layers",)):
        return 2
    for name in ("warps", "stages", "splits"):
        bad = [x for x in getattr(args, name) or () if x < 1]
        if bad:
            print(f"--{name} {bad}: each must be positive", file=sys.stderr)
            return 2
    try:
        result = bench_attention(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
