"""A run that fails shuts down in order: the checkpoint being written when the error came is
completed (never left half-written), no background thread prints a traceback after the error,
the error itself is the last thing printed and the exit code is non-zero."""

import glob
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a whole `python -m launch.train` run in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_failure_after_the_warm_start_exits_cleanly(tmp_path):
    # The warm start's checkpoint 0 is saved asynchronously; right after it the rollout engine
    # fails to start (its vLLM server does not exist): the failure the shutdown must survive.
    cmd = [sys.executable, "-m", "launch.train", "--set", f"run_root={tmp_path}"]
    for kv in (
        "name=fails",
        "sft.steps=3",
        "sft.batch_size=8",
        "rollout.engine=vllm",
        "rollout.vllm.urls=[http://127.0.0.1:9]",
        "logging.progress=false",
    ):
        cmd += ["--set", kv]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: VLLMError:") and "127.0.0.1:9" in last, out.stderr[-3000:]
    assert "cannot schedule new futures" not in out.stderr
    assert "while shutting down" not in out.stderr
    run = tmp_path / "fails" / "checkpoints"
    assert os.path.isdir(run / "0"), os.listdir(run)  # the warm start's checkpoint, committed
    assert not glob.glob(str(run / "*tmp*")), os.listdir(run)  # nothing half-written
