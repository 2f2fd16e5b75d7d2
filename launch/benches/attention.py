"""python -m launch.bench attention: one decode step's attention, the Pallas kernel
(models.decode_attention, keys [B, K, S, H]) against XLA's path (the slot writes, then
models.transformer._decode_attention over the whole cache, keys [B, K, H, S]), at a model's
shapes for cached lengths of a few blocks; each timed over distinct layers' caches, so that
HBM, not L2, serves them. On a GPU the times are the profiler's kernel times; elsewhere wall
clock (the kernel interpreted: a check that it runs, not a speed)."""

from __future__ import annotations

import argparse
import sys
import time

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


def _paths(B, K, G, H, S, dtype, layers, position, seed):
    """(pallas, xla, args): jitted calls over `layers` distinct caches, every row at
    `position` (its cached slots [0, position) read, the current token written there)."""
    from models import decode_attention as da
    from models.transformer import _decode_attention, _write_slot

    keys = iter(jax.random.split(jax.random.key(seed), 3 + 2 * layers))
    arr = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)
    q, kn, vn = arr(B, K * G, H), arr(B, K, H), arr(B, K, H)
    k_sh = [arr(B, K, S, H) for _ in range(layers)]
    v = [arr(B, K, S, H) for _ in range(layers)]
    k_hs = [jnp.swapaxes(k, 2, 3) for k in k_sh]  # the same keys, positions minor
    pos = jnp.full((B,), position, jnp.int32)
    interpret = jax.default_backend() == "cpu"

    def pallas(ks, vs):
        out = [
            da.decode_attention(q, kn, vn, k, v, pos, k_pos=2, interpret=interpret)
            for k, v in zip(ks, vs)
        ]
        return [o for o, _, _ in out], [k for _, k, _ in out], [v for _, _, v in out]

    def xla(ks, vs):
        valid = jnp.arange(S)[None, :] <= pos[:, None]
        ks = [_write_slot(k, kn, pos, 3) for k in ks]
        vs = [_write_slot(v, vn, pos, 2) for v in vs]
        return [_decode_attention(q, k, v, valid, 3) for k, v in zip(ks, vs)], ks, vs

    donate = dict(donate_argnums=(0, 1))  # the caches updated in place, as in the engine
    return jax.jit(pallas, **donate), jax.jit(xla, **donate), (k_sh, v), (k_hs, [x + 0 for x in v])


def _time(fn, caches, calls: int) -> tuple[float, list]:
    """(us a layer, the first call's outputs): profiler kernel time on a GPU, else wall clock."""
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
    return us, first


def bench_attention(args) -> dict:
    from models import decode_attention as da

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
    print(
        f"attention: {args.preset} {cfg.dtype} batch={B} kv heads={K} query heads={N} "
        f"head dim={H} cache={S} layers={L}; {'kernel' if gpu else 'wall'} time a layer"
    )
    item = jnp.dtype(cfg.dtype).itemsize
    result, ratios = {}, []
    for p in positions:
        pallas, xla, kv_sh, kv_hs = _paths(B, K, N // K, H, S, cfg.dtype, L, p, args.seed)
        with jax.default_matmul_precision(cfg.precision):  # as the model: float32 means float32
            t_pallas, o_pallas = _time(pallas, kv_sh, args.calls)
            t_xla, o_xla = _time(xla, kv_hs, args.calls)
        diff = float(np.abs(o_pallas - o_xla).max())  # the same inputs: one rounding apart
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
    result["speedup_geomean"] = float(np.exp(np.mean(np.log(ratios))))
    print(f"kernel against XLA: {fmt(result['speedup_geomean'], 3)}x (geometric mean)")
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
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the attention benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("batch", "cache_len", "calls"), zero_ok=("layers",)):
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
