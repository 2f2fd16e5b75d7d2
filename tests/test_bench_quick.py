"""Quick checks of code the fast tier would otherwise not run: the ceilings benchmark at tiny
sizes, the publish benchmark's copy, and the vLLM worker extension's RPC names (the client in
rl/rollout/vllm.py calls them by name; the slow tier runs them inside a vLLM server)."""

import os
import re

from launch.benches import ceilings, publish
from rl.rollout import vllm_worker_ext


def test_ceilings_prints_its_result_line(capsys):
    assert ceilings.main(["--matmul-size", "64", "--copy-mib", "1", "--repeats", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and "=" in last


def test_publish_copy_weights_copies_the_safetensors_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "model-00001-of-00002.safetensors").write_bytes(b"a" * 1000)
    (src / "model-00002-of-00002.safetensors").write_bytes(b"b" * 24)
    (src / "config.json").write_text("{}")
    seconds, nbytes = publish.copy_weights(str(src), str(dst))
    assert nbytes == 1024 and seconds >= 0
    assert sorted(os.listdir(dst)) == sorted(p.name for p in src.glob("*.safetensors"))


def test_every_rpc_the_vllm_client_calls_is_on_the_worker_extension():
    client = open(os.path.join(os.path.dirname(vllm_worker_ext.__file__), "vllm.py")).read()
    names = set(re.findall(r"tandem_[a-z_]+", client))
    assert names and all(callable(getattr(vllm_worker_ext.TandemWorkerExtension, n)) for n in names)
