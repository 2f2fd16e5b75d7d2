"""python -m launch.bench ceilings: the measured bf16 matmul rate and device-to-device copy
bandwidth of this device, the practical ceilings the learner and sampler figures compare to."""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp

from launch.benches.common import device_summary, print_result, reject_nonpositive, timed


def bench_ceilings(args) -> dict:
    """Measures the bf16 matmul rate and the copy bandwidth of the first device."""
    device_summary()
    n = args.matmul_size
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    timed(mm, a, b)
    mm_s = statistics.median(timed(mm, a, b)[0] for _ in range(args.repeats))
    x = jax.random.normal(ka, (args.copy_mib * 2**20 // 2,), jnp.bfloat16)
    cp = jax.jit(lambda x: x + 1)  # reads and writes every element once
    timed(cp, x)
    cp_s = statistics.median(timed(cp, x)[0] for _ in range(args.repeats))
    tflops = 2 * n**3 / mm_s / 1e12
    tb_s = 2 * x.nbytes / cp_s / 1e12
    print(f"bf16 matmul {n}^3: {mm_s * 1e3:.2f} ms = {tflops:.1f} TFLOP/s")
    print(f"copy {x.nbytes / 2**20:.0f} MiB (read + write): {cp_s * 1e3:.2f} ms = {tb_s:.2f} TB/s")
    return dict(matmul_tflops=tflops, copy_tb_s=tb_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench ceilings",
        description="measured bf16 matmul rate and copy bandwidth",
    )
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the ceilings benchmark and prints its RESULT line last."""
    args = _parser().parse_args(argv)
    if reject_nonpositive(args, ("repeats",)):
        return 2
    print_result(bench_ceilings(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
