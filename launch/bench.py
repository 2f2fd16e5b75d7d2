"""python -m launch.bench NAME [options]: runs one benchmark of launch/benches/; each prints its
figures, then one last line `RESULT name=value ...` ("n/a" where a device's peak is unknown)."""

from __future__ import annotations

import argparse
import importlib
import sys

# NAME: (module, what it measures). Modules load on demand: `async` pins this process's cores
# before anything initialises JAX's backend.
BENCHES = {
    "learner": ("launch.benches.learner", "Learner.update throughput and MFU"),
    "sampler": ("launch.benches.sampler", "JaxEngine decode throughput and memory roofline"),
    "attention": ("launch.benches.attention", "Pallas decode attention against XLA's, per layer"),
    "ceilings": ("launch.benches.ceilings", "measured bf16 matmul rate and copy bandwidth"),
    "async": ("launch.benches.async_bench", "the real trainer, synchronous vs fully async"),
    "publish": ("launch.benches.publish", "weight publication against a plain copy"),
    "weight_sync": ("launch.benches.weight_sync", "vLLM weight sync: HF directory vs direct"),
    "startup": ("launch.benches.startup", "a job's start: cold and warm compilation cache"),
    "layout": ("launch.benches.layout", "the learner's sharding plan on fake CPU devices"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench",
        description="Runs one benchmark; it prints its figures, then `RESULT name=value ...`.",
        epilog="`python -m launch.bench NAME --help` lists a benchmark's options.",
    )
    sub = p.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, (_, help_) in BENCHES.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark NAME with the remaining arguments; returns its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHES:
        _parser().parse_args(argv)  # prints the usage (or --help) and exits
        return 2
    module = importlib.import_module(BENCHES[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
