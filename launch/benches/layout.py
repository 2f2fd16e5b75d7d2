"""python -m launch.bench layout: the learner's sharding plan, checked on fake CPU devices.

For each mesh layout it lowers and compiles the trainer's update step (packed rows, the remat
policy, the chunked log-prob head) for a model of any size on N devices of this CPU
(--xla_force_host_platform_device_count; nothing is allocated or run) and reads the compiled
program: each device's state and temporary memory, and its collectives. The check: no
parameter is all-gathered whole, neither a stacked one (every layer at once) nor the embedding
or head; under fsdp a layer's weights are gathered inside the layer loop, one layer at a time.
CPU memory figures come from the CPU backend's buffer assignment: a GPU's differs in its
fusions and temporaries, not in what the state costs each device.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from launch.benches.common import PRESETS, model_config, print_result

LAYOUTS = ("data", "fsdp", "fsdp_tensor")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(
    r"= (\(?[a-z0-9]+\[[0-9,]*\][^ ]*(?:, [a-z0-9]+\[[0-9,]*\][^ ]*)*\)?) "
    r"(" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)
_SHAPE = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def mesh_shape(layout: str, n: int, tensor: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of a layout on n devices."""
    if layout == "data":
        return n, 1, 1
    if layout == "fsdp":
        return 1, n, 1
    t = min(tensor, n)
    if n % t:
        raise ValueError(f"--tensor {tensor} does not divide {n} devices")
    return 1, n // t, t


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result shape) of every collective in a compiled program's HLO text (a tuple result:
    each of its shapes)."""
    out = []
    for shapes, op in _OP.findall(hlo):
        for dims in _SHAPE.findall(shapes):
            out.append((op, tuple(int(d) for d in dims.split(",") if d)))
    return out


def classify_gathers(gathers, param_shapes, num_layers: int) -> dict[str, list]:
    """All-gather results by what they gather, from their shapes: a whole matrix parameter (its
    global shape: a stacked one's every layer, the embedding, the head), a whole vector one (a
    norm's weight), one layer of a stacked parameter, or anything else (activations)."""
    whole = {tuple(s) for s in param_shapes}
    layer = {tuple(s[1:]) for s in param_shapes if len(s) > 1 and s[0] == num_layers}
    out: dict[str, list] = {"whole_param": [], "vector_param": [], "layer_param": [], "other": []}
    for shape in gathers:
        if shape in whole:
            kind = "whole_param" if len(shape) > 1 else "vector_param"
        else:
            kind = "layer_param" if shape in layer else "other"
        out[kind].append(shape)
    return out


def plan(cfg, layout: str, n: int, args) -> dict:
    """Compiles the update step of `cfg` on the first n devices laid out as `layout`."""
    import jax
    import optax

    from launch.benches.learner import auto_chunk, synthetic_batch
    from models import make_mesh
    from rl.learner import Learner, StepConfig

    data, fsdp, tensor = mesh_shape(layout, n, args.tensor)
    mesh = make_mesh(data, fsdp, tensor, devices=jax.devices()[:n])
    chunk = auto_chunk(cfg.vocab_size)
    learner = Learner.abstract(
        cfg, optax.adamw(1e-6), mesh=mesh, step_cfg=StepConfig(logprob_chunk=chunk)
    )
    batch = synthetic_batch(cfg.vocab_size, args.batch, args.seq, seed=0)
    compiled = learner.lower_update(batch).compile()
    mem = compiled.memory_analysis()
    state = jax.tree.leaves(learner.state)
    state_bytes = sum(_nbytes(s.sharding.shard_shape(s.shape), s.dtype) for s in state)
    ops = collectives(compiled.as_text())
    params = [s.shape for s in state if len(s.shape) >= 1]
    gathers = classify_gathers(
        [shape for op, shape in ops if op == "all-gather"], params, cfg.num_hidden_layers
    )
    gib = 2.0**30
    row = {
        "mesh": f"{data}x{fsdp}x{tensor}",
        "state_gib": state_bytes / gib,
        "temp_gib": mem.temp_size_in_bytes / gib,
        "peak_gib": (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
        / gib,
        "collectives": {op: sum(o == op for o, _ in ops) for op in COLLECTIVES},
        "gathers": gathers,
    }
    return row


def _nbytes(shape, dtype) -> int:
    import numpy as np

    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench layout",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--preset", default="qwen2_1p5b", choices=PRESETS)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {LAYOUTS}")
    p.add_argument("--devices", default="1,2,4,8", help="device counts")
    p.add_argument("--tensor", type=int, default=2, help="the tensor axis of fsdp_tensor")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--remat", default="full", choices=("full", "dots_saveable", "none"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Prints each layout's plan, then the RESULT line; exit 1 when a parameter is gathered
    whole."""
    args = _parser().parse_args(argv)
    layouts = args.layouts.split(",")
    bad = [x for x in layouts if x not in LAYOUTS]
    counts = [int(x) for x in args.devices.split(",")]
    if bad or min(counts) < 1 or args.tensor < 1:
        print(
            f"--layouts {bad} / --devices {counts} / --tensor {args.tensor}: invalid; "
            f"layouts are {LAYOUTS}, counts and --tensor positive",
            file=sys.stderr,
        )
        return 2
    flag = f"--xla_force_host_platform_device_count={max(counts)}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if len(jax.devices()) < max(counts):
        print(
            f"{len(jax.devices())} CPU devices, {max(counts)} needed: JAX started before "
            f"{flag} was set",
            file=sys.stderr,
        )
        return 2
    cfg = model_config(
        args.preset,
        dtype=args.dtype,
        param_dtype="float32",
        attention_impl="xla",
        remat=args.remat,
    )
    print(
        f"layout: {args.preset} ({cfg.num_params / 1e9:.2f} B params, float32 state + Adam, "
        f"{args.dtype} compute, remat {args.remat}), batch {args.batch}x{args.seq} packed, "
        "compiled for fake CPU devices"
    )
    result: dict = {}
    whole = 0
    for layout in layouts:
        for n in counts:
            if n == 1 and layout != layouts[0]:
                continue  # one device: every layout is the same program
            row = plan(cfg, layout, n, args)
            g = row["gathers"]
            whole += len(g["whole_param"])
            c = row["collectives"]
            print(
                f"{layout:12s} {n} devices (mesh {row['mesh']}): state {row['state_gib']:.2f} "
                f"GiB/device, temporaries {row['temp_gib']:.2f} GiB, peak ~{row['peak_gib']:.2f} "
                f"GiB; all-gathers {c['all-gather']} (whole params {len(g['whole_param'])}, "
                f"norm vectors {len(g['vector_param'])}, one layer {len(g['layer_param'])}, "
                f"other {len(g['other'])}), all-reduces "
                f"{c['all-reduce']}, reduce-scatters {c['reduce-scatter']}"
            )
            if g["whole_param"]:
                print(f"  whole parameters gathered: {sorted(set(g['whole_param']))}")
            if g["other"]:
                print(f"  other gathers: {sorted(set(g['other']))}")
            key = f"{layout}{n}"
            result[f"{key}_state_gib"] = row["state_gib"]
            result[f"{key}_peak_gib"] = row["peak_gib"]
            result[f"{key}_whole_param_gathers"] = len(g["whole_param"])
    print_result(result)
    return 1 if whole else 0


if __name__ == "__main__":
    sys.exit(main())
