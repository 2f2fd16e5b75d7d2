"""vLLM hosts: launching and stopping vLLM OpenAI servers (their process lifecycle, health,
logs) and checking the published HF weight directories they reload.

A launched server gets its own process group in the caller's session (stop() ends the engine
core too), `--logprobs-mode processed_logprobs` and this project's worker extension (a tied
lm_head is re-tied after a reload); with die_with_parent it dies with the process that launched
it. The engine that drives the hosts is rl/rollout/vllm.py.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import requests

from rl.checkpoint import sha256_file
from rl.rollout.base import RolloutError

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rl.rollout.vllm_worker_ext.TandemWorkerExtension"
WEIGHT_TRANSFER_BACKEND = "tandem"  # registered by the worker extension (vllm_weight_engine.py)
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class VLLMError(RolloutError):
    """A vLLM host failed, timed out, or refused a request or a weights directory."""


class VLLMHostsDown(VLLMError):
    """Every host of an engine is dead or hung: the engine cannot serve until one comes back."""


# ---------------------------------------------------------------------------------------------
# Published weights directories.


def verify_weights_dir(path: str, version: int | None = None, *, checksums: bool = True) -> dict:
    """Checks a published HF weights dir (not .tmp, manifest sha256s, all shards); returns it."""
    path = os.path.abspath(path)
    if os.path.basename(os.path.normpath(path)).endswith(".tmp"):
        raise VLLMError(f"weights dir {path!r} is a half-written .tmp dir; pass the renamed dir")
    if not os.path.isdir(path):
        raise VLLMError(f"weights dir {path!r} does not exist")
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise VLLMError(f"weights dir {path!r} has no manifest.json (written last on publish)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        manifest_version = int(manifest["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise VLLMError(
            f"{manifest_path} is not {{'version': int, 'files': {{name: sha256}}}}: {e!r}"
        ) from e
    if not isinstance(files, dict) or not files:
        raise VLLMError(f"{manifest_path} lists no files")
    if version is not None and manifest_version != version:
        raise VLLMError(
            f"{manifest_path} says version {manifest_version}, but version {version} was asked"
        )
    if "config.json" not in files:
        raise VLLMError(f"{manifest_path} does not list config.json")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        if shard not in files:
            raise VLLMError(f"shard {shard!r} of {path!r} is not in its manifest.json")
    for name, digest in sorted(files.items()):
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise VLLMError(f"{path!r} misses {name!r} (listed in manifest.json)")
        if checksums and sha256_file(file_path) != digest:
            raise VLLMError(f"sha256 of {file_path!r} does not match manifest.json ({digest})")
    return manifest


def ties_word_embeddings(path: str) -> bool:
    """Whether the HF config in path ties lm_head to embed_tokens (transformers' default: yes)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(config.get("text_config", {}).get("tie_word_embeddings", True))


# ---------------------------------------------------------------------------------------------
# HTTP.

_local = threading.local()


def http_session() -> requests.Session:
    """This thread's HTTP session (keep-alive connections to the hosts)."""
    if not hasattr(_local, "session"):
        _local.session = requests.Session()
    return _local.session


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Hosts.


class VLLMHost:
    """One vLLM OpenAI-compatible server: a subprocess launched here, or an existing URL."""

    def __init__(self, url: str, *, process: subprocess.Popen | None = None, log_path=None):
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path
        self._log_file = None
        self._stopped = False

    @classmethod
    def connect(cls, url: str) -> VLLMHost:
        """A host already running at url (started with VLLM_SERVER_DEV_MODE=1 and our flags)."""
        return cls(url)

    @classmethod
    def launch(
        cls,
        model_dir: str,
        *,
        log_path: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        enforce_eager: bool = True,
        kv_cache_gib: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
        cpus: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
    ) -> VLLMHost:
        """Starts `python -m vllm.entrypoints.openai.api_server` for model_dir; see wait_ready.

        die_with_parent (Linux): the server gets SIGTERM when the launching thread's process
        dies, even by SIGKILL (a Ray rollout worker killed or lost leaves no orphan server).
        Launch from a thread that lives as long as the process (a Ray actor's constructor).
        """
        port = _free_port(host) if port is None else port
        if log_path is None:
            log_path = os.path.join(tempfile.gettempdir(), f"vllm-{host}-{port}.log")
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            os.path.abspath(model_dir),
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--logprobs-mode",
            "processed_logprobs",
            "--generation-config",
            "vllm",  # neutral sampling defaults, never the model dir's generation_config.json
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--weight-transfer-config",
            json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
            "--seed",
            str(seed),
        ]
        if enforce_eager:
            cmd.append("--enforce-eager")
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        cmd += list(extra_args)
        proc_env = dict(os.environ)
        proc_env.update(env or {})
        proc_env["VLLM_SERVER_DEV_MODE"] = "1"
        proc_env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        proc_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if cpus is not None:
            proc_env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        python_path = [_PROJECT_ROOT] + [p for p in [proc_env.get("PYTHONPATH")] if p]
        proc_env["PYTHONPATH"] = os.pathsep.join(python_path)
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        log_file.write(f"$ {' '.join(cmd)}\n".encode())
        log_file.flush()
        # Its own process group (stop() ends the engine core too), but the caller's session: in
        # a session of its own, Linux's autogroup scheduler gives the busy server a share that
        # starves the caller while a long request decodes (docs/vllm.md).
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        if die_with_parent:
            group["preexec_fn"] = _die_with_parent_preexec(group.get("preexec_fn"))
        process = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=proc_env,
            cwd=_PROJECT_ROOT,
            **group,
        )
        host_obj = cls(f"http://{host}:{port}", process=process, log_path=log_path)
        host_obj._log_file = log_file
        atexit.register(host_obj.stop, grace_s=5.0)  # no orphan servers after a normal exit
        return host_obj

    def __repr__(self) -> str:
        return f"VLLMHost({self.describe()})"

    def describe(self) -> str:
        """The host's URL and, if launched here, its pid and log file."""
        if self.process is None:
            return self.url
        return f"{self.url} (pid {self.process.pid}, log {self.log_path})"

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the host's log file ('' if it has none)."""
        if not self.log_path or not os.path.isfile(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - 64 * 1024))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def exit_code(self) -> int | None:
        """The launched process's exit code, or None while it runs (or if not launched here)."""
        return None if self.process is None else self.process.poll()

    def failure_message(self, what: str) -> str:
        """An error message about this host, with its exit code and log tail when known."""
        msg = f"vLLM host {self.describe()}: {what}"
        code = self.exit_code()
        if code is not None:
            msg += f"; the server process exited with code {code}"
        tail = self.log_tail()
        if tail:
            msg += f"\n--- last lines of {self.log_path} ---\n{tail}"
        return msg

    def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether GET /health answers 200."""
        if self.exit_code() is not None:
            return False
        try:
            return http_session().get(self.url + "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, deadline_s: float, *, stop_on_failure: bool = True) -> None:
        """Polls /health until 200; raises VLLMError (naming URL and log) on exit or deadline."""
        end = time.monotonic() + deadline_s
        while True:
            code = self.exit_code()
            if code is not None:
                err = self.failure_message("exited before becoming ready")
                break
            if self.is_healthy(timeout_s=2.0):
                return
            if time.monotonic() >= end:
                err = self.failure_message(f"not ready within {deadline_s:g} s")
                break
            time.sleep(0.5)
        if stop_on_failure:
            self.stop()
        raise VLLMError(err)

    def stop(self, grace_s: float = 20.0) -> None:
        """Ends a launched server's process group: SIGTERM, then SIGKILL after grace_s."""
        if self.process is not None and not self._stopped:
            self._stopped = True
            if self.process.poll() is None:
                _signal_group(self.process, signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("vLLM host %s ignored SIGTERM; sending SIGKILL", self.describe())
            _signal_group(self.process, signal.SIGKILL)  # stragglers of the group (engine core)
            self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def launch_hosts(
    model_dir: str,
    log_paths: Sequence[str],
    *,
    ready_timeout_s: float,
    seed: int = 0,
    **launch_kwargs,
) -> list[VLLMHost]:
    """One server per log path (seeds seed, seed + 1, ...), each ready within ready_timeout_s;
    if any fails to launch or become ready, every one launched is stopped."""
    hosts: list[VLLMHost] = []
    try:
        for i, log_path in enumerate(log_paths):
            hosts.append(
                VLLMHost.launch(model_dir, log_path=log_path, seed=seed + i, **launch_kwargs)
            )
        for h in hosts:
            h.wait_ready(ready_timeout_s)
    except BaseException:
        for h in hosts:
            h.stop()
        raise
    return hosts


def _die_with_parent_preexec(then=None):
    """A preexec_fn: PR_SET_PDEATHSIG(SIGTERM) for the child, then `then()`."""

    def preexec():
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if then is not None:
            then()

    return preexec


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # pgid == pid: started as its own process group
    except (ProcessLookupError, PermissionError):
        pass
