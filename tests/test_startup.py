"""rl/startup.py: where the compilation cache lives for each trainer.compile_cache setting, a
second process loading its programs from the cache (the counters saying so), and the config's
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl import config as C
from rl import startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process of a run, in miniature: the cache as the setting says, then three programs.
_PROCESS = """
import json, sys
import jax, jax.numpy as jnp
from rl import startup
path = startup.enable_cache(sys.argv[1])
counter = startup.CompileCounter()
x = jnp.arange(8.0)
jax.jit(lambda a: a * 2 + 1)(x).block_until_ready()
jax.jit(lambda a: jnp.sin(a).sum())(x).block_until_ready()
def dot(a):
    return a @ a
jax.jit(dot)(x).block_until_ready()
jax.jit(dot)(x[:4]).block_until_ready()
by_name = counter.programs_since_start()
print(json.dumps({"path": path, **counter.since_start(), "by_name": by_name}))
"""


def _process(setting: str, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROCESS, setting],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def test_cache_directory_of_each_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert startup.cache_dir("auto") == str(tmp_path / "env")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert startup.cache_dir("auto") == str(tmp_path / "xdg" / "tandem" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert startup.cache_dir("auto") == str(tmp_path / "home" / ".cache" / "tandem" / "jax")
    assert startup.cache_dir("off") is None
    monkeypatch.chdir(tmp_path)
    assert startup.cache_dir("here/jit") == str(tmp_path / "here" / "jit")


def test_second_process_loads_its_programs_from_the_cache(tmp_path):
    """The default setting with no JAX_COMPILATION_CACHE_DIR: the per-user directory. The
    first process compiles and writes every program; the second compiles none."""
    env = _env(HOME=str(tmp_path), XDG_CACHE_HOME="")
    cold = _process("auto", env)
    assert cold["path"] == str(tmp_path / ".cache" / "tandem" / "jax")
    assert cold["compile/programs"] >= 3
    assert cold["compile/cache_hits"] == 0 and cold["compile/cache_misses"] >= 3
    assert len(os.listdir(cold["path"])) >= 3
    warm = _process("auto", env)
    assert warm["compile/programs"] == cold["compile/programs"]
    assert cold["by_name"]["jit(dot)"][0] == 2  # by program name: two shapes of one function
    assert sum(n for n, _ in cold["by_name"].values()) == cold["compile/programs"]
    assert warm["compile/cache_hits"] == warm["compile/programs"]
    assert warm["compile/cache_misses"] == 0

    off = _process("off", env)  # compiles everything again and writes nothing
    assert off["path"] is None and off["compile/cache_hits"] == 0
    assert off["compile/cache_misses"] == 0 and off["compile/programs"] >= 3
    assert len(os.listdir(cold["path"])) == len(os.listdir(warm["path"]))


def test_cache_setting_errors_name_the_key(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(C.ConfigError, match=r"trainer.compile_cache: invalid value .*file"):
        C.load(None, [f"trainer.compile_cache={not_a_dir}"])
    with pytest.raises(C.ConfigError, match="trainer.compile_cache: invalid value ''"):
        C.load(None, ["trainer.compile_cache=''"])
    # A directory that cannot be made (under a file): named when the run starts, before work.
    with pytest.raises(C.ConfigError, match=r"trainer.compile_cache: .*cannot create"):
        startup.enable_cache(str(not_a_dir / "jit"))


def test_auto_without_a_writable_cache_directory_runs_without_the_cache(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    env = _env(HOME=str(tmp_path), XDG_CACHE_HOME=str(not_a_dir))
    out = _process("auto", env)
    assert out["path"] is None and out["compile/cache_hits"] == 0
    assert out["compile/programs"] >= 3


def test_summary_line_names_both_processes():
    here = {"compile/seconds": 3.25, "compile/programs": 12, "compile/cache_hits": 10}
    here["compile/cache_misses"] = 2
    child = {"compile/seconds": 7.5, "compile/programs": 40, "compile/cache_hits": 0}
    child["compile/cache_misses"] = 40
    line = startup.summary_line(21.04, here, child)
    assert line.startswith("[tandem] first update 21.0 s after start; compile time 3.2 s here")
    assert "(12 programs, cache 10 hits / 2 misses)" in line
    assert "7.5 s in the rollout process (40 programs, cache 0 hits / 40 misses)" in line


def test_slowest_programs_over_both_processes():
    here = {"jit(update)": [1, 30.5], "jit(eval)": [4, 2.0]}
    child = {"jit(decode)": [12, 6.25]}
    line = startup.slowest_programs(here, child, k=2)
    assert line == "; slowest: jit(update) 30.5 s, jit(decode) (rollout) 6.2 s (x12)"
    assert startup.slowest_programs({}, {}) == ""


def test_gemm_options_by_platform_and_setting():
    """trainer.gemm_autotune: cuBLAS without autotuning on a GPU unless asked; nothing set
    elsewhere; a program's own options kept. XLA knows the option names (a misspelt one fails
    to compile), checked by compiling with the GPU's options here."""
    import jax
    import jax.numpy as jnp

    assert startup.gemm_options(False, "cpu") is None
    assert startup.gemm_options(False, "tpu") is None
    assert startup.gemm_options(False, "gpu") == startup.CUBLAS_GEMMS
    assert startup.gemm_options(True, "gpu") is None
    base = {"xla_gpu_enable_triton_gemm": False}
    assert startup.gemm_options(True, "gpu", base) == base
    assert startup.gemm_options(False, "gpu", base) == startup.CUBLAS_GEMMS
    x = jnp.eye(4)
    f = jax.jit(lambda a: a @ a, compiler_options=startup.gemm_options(False, "gpu"))
    assert float(f(x).sum()) == 4.0
    typo = {"xla_gpu_enable_triton_gem": False}
    with pytest.raises(Exception, match="xla_gpu_enable_triton_gem"):
        jax.jit(lambda a: a @ a, compiler_options=typo)(x)
