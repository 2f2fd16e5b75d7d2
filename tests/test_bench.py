"""launch.bench (the dispatcher) and launch/benches/: the RESULT line of each benchmark on a tiny
model (CPU), and its FLOP/byte counts against hand-computed values."""

import math
import os
import subprocess
import sys

import pytest

from launch import bench
from launch.benches import common, learner, sampler
from models import qwen2_0p5b, tiny


def _parse_result(out: str) -> dict[str, str]:
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), f"last line: {lines[-1:]}"
    pairs = [kv.split("=", 1) for kv in lines[-1].split()[1:]]
    assert all(len(p) == 2 for p in pairs), lines[-1]
    return dict(pairs)


def _positive_finite(result: dict[str, str], *names: str) -> None:
    for name in names:
        value = float(result[name])
        assert math.isfinite(value) and value > 0, f"{name}={result[name]}"


@pytest.mark.slow
def test_learner_result_line(capsys):
    argv = "learner --preset tiny --batch 2 --seq 32 --chunk 48 --remat full --warmup 1 --steps 2"
    assert bench.main(argv.split()) == 0
    out = capsys.readouterr().out
    result = _parse_result(out)
    _positive_finite(result, "learner_tokens_per_s", "step_s", "model_tflops")
    assert result["mfu"] == "n/a"  # no datasheet peak for a CPU
    # tokens/s is the whole batch over the median step
    assert float(result["learner_tokens_per_s"]) == pytest.approx(
        2 * 32 / float(result["step_s"]), rel=1e-4
    )
    assert "32 of 64 tokens trained" in out  # half of each row


@pytest.mark.slow
def test_learner_compile_only(capsys):
    """--compile-only lowers and compiles the update step, decode chunk and prefill, runs none."""
    argv = "learner --preset tiny --batch 2 --seq 32 --compile-only --decode-chunk 2"
    assert bench.main(argv.split()) == 0
    out = capsys.readouterr().out
    result = _parse_result(out)
    parts = ("lower", "compile", "lower_cpu", "compile_cpu")
    names = [f"{p}_{s}_s" for p in ("learner", "decode", "prefill") for s in parts]
    assert sorted(result) == sorted(names)
    _positive_finite(result, *names)
    assert "warmup step" not in out and "tokens/s" not in out  # nothing was run


@pytest.mark.slow
def test_sampler_result_line_from_the_command_line():
    """The public surface: `python -m launch.bench sampler ...` in a fresh process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = "sampler --preset tiny --batch 3 --prompt-len 5 --new-tokens 6 --repeats 1".split()
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _parse_result(proc.stdout)
    _positive_finite(result, "sampler_tokens_per_s", "decode_tokens_per_s", "decode_step_s")
    assert result["roofline_frac"] == "n/a"


@pytest.mark.slow
def test_attention_result_line(capsys):
    """The Pallas decode attention (interpreted here) against XLA's on the same inputs: a time
    for each and outputs within float32 rounding at every position."""
    argv = "attention --preset tiny --dtype float32 --batch 2 --cache-len 64 --positions 0,17,63"
    assert bench.main([*argv.split(), "--layers", "2", "--calls", "1"]) == 0
    result = _parse_result(capsys.readouterr().out)
    for p in (0, 17, 63):
        _positive_finite(result, f"kernel_us_p{p}", f"xla_us_p{p}")
        assert float(result[f"max_diff_p{p}"]) < 1e-5, result
    _positive_finite(result, "speedup_geomean")


def test_attention_sweeps_launch_constants(capsys):
    """Every (block, warps, stages, splits) of the lists is timed, its outputs checked, the
    kernel's own constants restored afterwards."""
    from models import decode_attention as da

    before = (da.BLOCK_S, da.WARPS, da.STAGES, da.SPLITS)
    argv = "attention --preset tiny --dtype float32 --batch 2 --cache-len 64 --positions 40"
    argv += " --layers 1 --calls 1 --blocks 16,32 --splits 1,2"
    assert bench.main(argv.split()) == 0
    out = capsys.readouterr().out
    result = _parse_result(out)
    assert (da.BLOCK_S, da.WARPS, da.STAGES, da.SPLITS) == before
    rows = [line for line in out.splitlines() if line.startswith("  (")]
    assert len(rows) == 5  # the default (64 slots) and the four of the grid
    assert sum("(the default)" in r for r in rows) == 1
    assert float(result["sweep_max_diff"]) < 1e-5
    _positive_finite(result, "best_speedup_over_default")


def test_attention_bad_position_is_rejected(capsys):
    assert bench.main("attention --preset tiny --cache-len 64 --positions 64".split()) == 2
    assert "--positions [64]: each must be in [0, --cache-len=64)" in capsys.readouterr().err
    assert (
        bench.main("attention --preset tiny --cache-len 64 --positions 0 --blocks 48".split()) == 2
    )
    assert "--blocks [48]: each a power of two >= 16 that divides 64" in capsys.readouterr().err
    assert bench.main("attention --preset tiny --warps 0".split()) == 2
    assert "--warps [0]: each must be positive" in capsys.readouterr().err


def test_bad_argument_is_rejected(capsys):
    assert bench.main("learner --preset tiny --batch 0".split()) == 2
    assert "--batch=0" in capsys.readouterr().err


def test_learner_flops_by_hand():
    """tiny: D=128, q_dim=128, kv_dim=64, F=512, L=2, V=128, rows of T=32 tokens."""
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 512  # q, k, v, o, MLP
    n = 2 * per_layer + 128 * 128  # + LM head
    fl = learner.learner_flops(tiny(), 32, remat="none", chunk=0)
    assert fl.matmul_params == n == 507_904
    assert fl.model == 6 * n + 12 * 2 * 32 * 128 == 3_145_728
    assert fl.model_causal == 6 * n + 6 * 2 * 32 * 128
    assert fl.executed == fl.model
    full = learner.learner_flops(tiny(), 32, remat="full", chunk=64)
    assert full.executed == fl.model + (2 * 2 * per_layer + 4 * 2 * 32 * 128) + 2 * 128 * 128


def test_qwen2_0p5b_flops_and_decode_bytes_by_hand():
    cfg = qwen2_0p5b(dtype="bfloat16", param_dtype="bfloat16")
    # Qwen2.5-0.5B: 24 x (896*896*2 + 2*896*128 + 3*896*4864) + 896*151936 (tied head)
    matmuls = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    n = 24 * matmuls + 896 * 151936
    assert learner.learner_flops(cfg, 1024).matmul_params == n == 493_961_216
    nb = sampler.decode_bytes(cfg, batch=8, prompt_len=128, new_tokens=256, cache_len=384)
    layer = matmuls + 896 + 2 * 128 + 2 * 896  # + q/k/v biases + two norms
    assert nb.params == 2 * (896 * 151936 + 24 * layer + 896)  # bf16, tied embedding read once
    per_pos = 2 * 24 * 2 * 64 * 2  # k and v, 24 layers, 2 kv heads of 64, bf16
    assert nb.kv_needed == 8 * per_pos * (128 + 128)
    assert nb.kv_allocated == 8 * per_pos * 384


def test_device_peaks_and_auto_chunk():
    assert common.device_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert common.device_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert common.device_peaks("NVIDIA H100 PCIe") == (None, None)
    assert common.device_peaks("cpu") == (None, None)
    assert learner.auto_chunk(151936) == 15232  # 10 chunks, 384 padded ids
    assert learner.auto_chunk(128) == 128


def test_weight_sync_delta_check_is_bit_exact_and_refuses_a_wrong_base(tmp_path):
    """The weight_sync bench's own check (its delta decoded against the base, bit for bit) on the
    main job's model after one of its Adam-like steps; decoding against another base fails."""
    import types

    import jax
    import numpy as np
    from flax import nnx

    import models
    from launch.benches import weight_sync
    from rl.rollout import weight_wire
    from rl.rollout.weight_stream import WeightStreamer

    params = nnx.state(
        models.create_model(
            tiny(dtype="float32", param_dtype="float32"),
            models.make_mesh(devices=jax.devices()[:1]),
            seed=0,
        ),
        nnx.Param,
    )
    streamer = WeightStreamer("bfloat16", delta=True, shm_dir=str(tmp_path))
    try:
        first = streamer.begin(streamer.snapshot(params), 1)
        assert weight_sync._check_delta(streamer, first, None) == (0, 0)  # no base: no delta
        streamer.finish(first, served=True)
        stepped = weight_sync._optimizer_step(params, 2e-4, seed=1)
        prepared = streamer.begin(streamer.snapshot(stepped), 2)
        equal, checked = weight_sync._check_delta(streamer, prepared, first)
        assert checked == len(prepared.tensors) and equal == checked
        delta, _ = streamer.sent("delta")
        assert delta.nbytes < streamer.sent("full")[0].nbytes
        # A base the delta is not on (every element's lowest bit flipped): the checksums say so.
        other = types.SimpleNamespace(
            tensors={k: (v.view(np.uint16) ^ 1).view(v.dtype) for k, v in first.tensors.items()}
        )
        with pytest.raises(weight_wire.WireError, match="checksum"):
            weight_sync._check_delta(streamer, prepared, other)
    finally:
        streamer.close()


def test_weight_sync_bad_repeats_is_rejected(capsys):
    assert bench.main("weight_sync --repeats 0".split()) == 2
    assert "--repeats=0" in capsys.readouterr().err


def test_startup_cold_then_warm_from_the_cache(capsys, tmp_path):
    """Two short jobs: the second loads every program the first compiled (both processes).
    The rollout is batch-invariant (fixed shapes, every program warmed before serving), so the
    two runs compile the same programs: on a CPU the default slots and cache length follow the
    demand, and which shapes a run meets before its first update depends on timing."""
    sets = [
        "rollout.batch_invariant=true",
        "sft.steps=4",
        "trainer.total_updates=1",
        "task.num_eval=8",
        "task.eval_samples=0",
        "rollout.prompts_per_update=2",
        "rollout.group_size=2",
        "logging.tensorboard=false",
    ]
    argv = ["startup", "--root", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    assert bench.main(argv) == 0
    result = _parse_result(capsys.readouterr().out)
    _positive_finite(result, "cold_update0_s", "warm_update0_s", "warm_first_update_s")
    assert float(result["cold_compile_cache_hits"]) == 0
    assert float(result["cold_compile_cache_misses"]) > 0
    for where in ("", "rollout_"):
        programs = float(result[f"warm_{where}compile_programs"])
        assert programs > 0 and float(result[f"warm_{where}compile_cache_hits"]) == programs
        assert float(result[f"warm_{where}compile_cache_misses"]) == 0
        assert float(result[f"cold_{where}compile_programs"]) == programs


def test_startup_bad_arguments_are_rejected(capsys, tmp_path):
    assert bench.main("startup --timeout-s 0".split()) == 2
    assert "--timeout-s=0" in capsys.readouterr().err
    assert bench.main(["startup", "--baseline-dir", str(tmp_path)]) == 2
    assert f"--baseline-dir {tmp_path}: no launch/train.py there" in capsys.readouterr().err
    assert bench.main(["startup", "--baseline-dir", ".", "--baseline-ref", "HEAD"]) == 2
    assert "give one of them" in capsys.readouterr().err
    (tmp_path / "runs").mkdir()  # an earlier bench's work directory
    assert bench.main(["startup", "--root", str(tmp_path)]) == 2
    assert f"--root {tmp_path}: not empty" in capsys.readouterr().err


def test_layout_reads_collectives_and_classifies_gathers():
    """launch.bench layout's HLO reading: each collective's result shapes (async starts and
    tuples too), and all-gathers sorted into whole matrices, norm vectors, one layer of a
    stacked parameter, and the rest."""
    from launch.benches import layout

    hlo = "\n".join(
        [
            "  %ag = f32[28,1536,8960]{2,1,0} all-gather(f32[28,192,8960]{2,1,0} %p), dims={1}",
            "  %ag.1 = bf16[1536,8960]{1,0} all-gather-start(bf16[192,8960]{1,0} %w)",
            "  %ar = (f32[16,1024]{1,0}, f32[]) all-reduce(f32[16,1024]{1,0} %x, f32[] %y)",
            "  %rs = f32[2,1536]{1,0} reduce-scatter(f32[16,1536]{1,0} %g), dimensions={0}",
            "  %n = f32[1536]{0} all-gather(f32[192]{0} %norm), dimensions={0}",
            "  %a = f32[16,1024,1536]{2,1,0} all-gather(f32[2,1024,1536]{2,1,0} %h)",
            "  %m = f32[16,1024]{1,0} multiply(f32[16,1024]{1,0} %x, f32[16,1024]{1,0} %x)",
        ]
    )
    ops = layout.collectives(hlo)
    assert ops == [
        ("all-gather", (28, 1536, 8960)),
        ("all-gather", (1536, 8960)),
        ("all-reduce", (16, 1024)),
        ("all-reduce", ()),
        ("reduce-scatter", (2, 1536)),
        ("all-gather", (1536,)),
        ("all-gather", (16, 1024, 1536)),
    ]
    params = [(28, 1536, 8960), (1536,), (151936, 1536)]
    gathers = layout.classify_gathers([s for op, s in ops if op == "all-gather"], params, 28)
    assert gathers == {
        "whole_param": [(28, 1536, 8960)],
        "vector_param": [(1536,)],
        "layer_param": [(1536, 8960)],
        "other": [(16, 1024, 1536)],
    }
    assert layout.mesh_shape("fsdp_tensor", 8, 2) == (1, 4, 2)
    assert layout.mesh_shape("data", 4, 2) == (4, 1, 1)


def test_layout_plan_shards_the_state_over_fsdp():
    """The plan of the tiny model's update step on 4 fake devices (the test session's): under
    fsdp each device holds a quarter of the float32 state and Adam moments (the stacked layers
    split on their embed axis), under data parallelism all of it; gradients all-reduce."""
    import argparse

    from launch.benches import layout

    args = argparse.Namespace(tensor=2, batch=8, seq=64)
    cfg = common.model_config("tiny", dtype="float32", attention_impl="xla", remat="full")
    data = layout.plan(cfg, "data", 4, args)
    fsdp = layout.plan(cfg, "fsdp", 4, args)
    assert data["mesh"] == "4x1x1" and fsdp["mesh"] == "1x4x1"
    state = 3 * 4 * cfg.num_params  # params + two Adam moments, float32
    assert data["state_gib"] * 2**30 >= state
    assert fsdp["state_gib"] < data["state_gib"] / 3.5
    assert data["collectives"]["all-reduce"] > 0 and data["gathers"]["whole_param"] == []
    assert fsdp["peak_gib"] > fsdp["state_gib"] > 0
