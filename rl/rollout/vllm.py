"""vLLM rollout engine: vLLM OpenAI servers (launched here or given as URLs), token ids in,
token ids + behavior log-probs + per-token policy versions out, weights reloaded from the
parameter server's published HF directories without a restart.

Version tagging (why every token's version is right). The engine never lets a request run on
a host while that host's weights change:
  * each host has a client-side gate; a request segment is sent only through an open gate, and
    the host's served version is read when it is sent;
  * `update_weights` closes the gate, then empties the host of this engine's in-flight requests
    ("drain": lets them finish; "abort"/"continue": POST /abort_requests until every in-flight
    HTTP call has returned), and only then pauses, reloads, sets the version and reopens.
So all tokens of one HTTP request come from the one version read when it was sent. (vLLM's
own /pause is not enough: a request that reaches a paused server waits and then runs on the NEW
weights after /resume.) With
update_mode "abort" an interrupted request returns finish_reason "abort" and its partial tokens;
with "continue" it is resubmitted with its prefix appended to the prompt (the KV cache is rebuilt
with the new weights), so its later tokens carry the new version (a partial rollout). The hosts
must be used by this engine only (another client's requests are not gated).

The servers run with `--logprobs-mode processed_logprobs`: a behavior log-prob is log p(token)
under the distribution it was sampled from (after temperature, top-k and top-p); at temperature
0 (greedy) vLLM reports the raw (temperature 1) log-prob of the greedy token. Generation stops
only at `SamplingParams.stop_token_ids` (the stop token is kept) or `max_new_tokens`: the
model's EOS stops nothing unless it is listed.

Failures are bounded: every HTTP call has a timeout, generate() has an overall deadline, a host
whose connection fails is marked unhealthy and its requests go to the others, and when no host
is healthy generate() raises VLLMError naming each host, its exit code and its log tail.
generate() may be called from many threads at once; update_weights() from another.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
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
import uuid
from collections.abc import Sequence

import numpy as np
import requests

from rl.metrics import BusyClock
from rl.param_server import sha256_file
from rl.rollout.base import (
    Generation,
    GenerationRequest,
    RolloutError,
    SamplingParams,
    Weights,
    WeightUpdate,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rl.rollout.vllm_worker_ext.TandemWorkerExtension"
UPDATE_MODES = ("drain", "abort", "continue")
PAUSE_MODES = ("abort", "wait", "keep")
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class VLLMError(RolloutError):
    """A vLLM host failed, timed out, or refused a request or a weights directory."""


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


def _session() -> requests.Session:
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
            return _session().get(self.url + "/health", timeout=timeout_s).status_code == 200
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


# ---------------------------------------------------------------------------------------------
# Engine.


@dataclasses.dataclass
class _HostState:
    host: VLLMHost
    version: int
    healthy: bool = True
    open: bool = True  # closed while the engine updates this host's weights
    inflight: int = 0  # this engine's HTTP calls to the host that have not returned
    update_epoch: int = 0  # bumped when an update starts; tells update-aborts from other aborts


@dataclasses.dataclass
class _Call:
    """One generate() call: its deadline, the abort epoch it started in, its in-flight ids."""

    end: float
    abort_epoch: int
    failed: bool = False
    inflight: dict[str, VLLMHost] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Segment:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class VLLMEngine:
    """The engine contract over N vLLM hosts (least-loaded dispatch, versioned weight reload)."""

    def __init__(
        self,
        hosts: Sequence[VLLMHost | str],
        *,
        version: int = 0,
        update_mode: str = "continue",
        request_timeout_s: float = 300.0,
        deadline_s: float = 3600.0,
        max_retries: int = 2,
        max_concurrency: int = 64,
        update_timeout_s: float = 120.0,
        verify_checksums: bool = True,
        owns_hosts: bool = False,
    ):
        if not hosts:
            raise ValueError("VLLMEngine needs at least one host (VLLMHost or URL)")
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode={update_mode!r}; valid: {UPDATE_MODES}")
        self.update_mode = update_mode
        self.request_timeout_s = request_timeout_s
        self.deadline_s = deadline_s
        self.max_retries = max_retries
        self.update_timeout_s = update_timeout_s
        self.verify_checksums = verify_checksums
        self.owns_hosts = owns_hosts
        self._cond = threading.Condition()
        self._update_lock = threading.Lock()
        self._paused: str | None = None
        self._aborted = False  # abort() until resume(): every generation returns 'abort'
        self._abort_epoch = 0
        self.clock = BusyClock()
        self.updates = 0
        self.sync_s = 0.0
        self._rr = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix="vllm-engine"
        )
        self._hosts = [
            _HostState(h if isinstance(h, VLLMHost) else VLLMHost.connect(h), version)
            for h in hosts
        ]
        for st in self._hosts:
            self._set_server_version(st.host, version)
        self.version = version

    # -- status --------------------------------------------------------------------------------

    @property
    def hosts(self) -> list[VLLMHost]:
        """The engine's hosts, in dispatch order."""
        return [st.host for st in self._hosts]

    @property
    def host_versions(self) -> dict[str, int]:
        """The acknowledged served version per host URL."""
        with self._cond:
            return {st.host.url: st.version for st in self._hosts}

    def inflight(self) -> dict[str, int]:
        """This engine's HTTP calls in flight per host URL (its current load)."""
        with self._cond:
            return {st.host.url: st.inflight for st in self._hosts}

    def health(self) -> dict[str, bool]:
        """Probes every host; healthy = /health answers and it serves self.version (or newer)."""
        out = {}
        for st in self._hosts:
            ok = st.host.is_healthy()
            with self._cond:
                # A host that failed an update stays out; one already on a newer version is in.
                st.healthy = ok and st.version >= self.version
                out[st.host.url] = st.healthy
                self._cond.notify_all()
        return out

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self, requests_: list[GenerationRequest], *, deadline_s: float | None = None
    ) -> list[Generation]:
        """Completes every request; blocks until all are finished or aborted (or raises)."""
        if not requests_:
            return []
        with self._cond:
            call = _Call(
                end=time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s),
                abort_epoch=self._abort_epoch,
            )
        self.clock.enter()
        out: list[Generation] = []
        try:
            futures = [self._pool.submit(self._run_request, r, call) for r in requests_]
            first_error: BaseException | None = None
            for fut in concurrent.futures.as_completed(futures):
                err = fut.exception()
                if err is not None and first_error is None:
                    first_error = err
                    self._cancel(call)  # the others return at once instead of running on
            if first_error is not None:
                raise first_error
            out = [f.result() for f in futures]
            return out
        finally:
            self.clock.exit(sum(len(g.token_ids) for g in out))

    def _cancel(self, call: _Call, min_timeout_s: float = 10.0) -> None:
        """Stops one generate() call's requests (and only those) after one of them failed.

        Aborts are repeated until every request of the call has returned, up to the call's
        deadline (at least `min_timeout_s`): a host whose API process is starved of CPU can
        take seconds to act on one, and a request left running would hold the host.
        """
        end = max(call.end, time.monotonic() + min_timeout_s)
        with self._cond:
            call.failed = True
            self._cond.notify_all()
        while time.monotonic() < end:
            with self._cond:
                inflight = list(call.inflight.items())
            if not inflight:
                return
            for rid, host in inflight:  # repeated: a request may not have reached vLLM yet
                self._abort_ids(host, [f"cmpl-{rid}-0"])
            with self._cond:
                self._cond.wait(timeout=0.05)

    def _run_request(self, req: GenerationRequest, call: _Call) -> Generation:
        params = req.params
        prompt = [int(t) for t in np.asarray(req.prompt_ids).reshape(-1)]
        if not prompt:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        errors: list[str] = []
        finish = "length"
        segment = 0
        while len(tokens) < params.max_new_tokens:
            rid = f"{req.request_id}-{segment}-{uuid.uuid4().hex[:8]}"
            acquired = self._acquire_host(req.request_id, rid, call, errors)
            if acquired is None:
                finish = "abort"
                break
            st, version, epoch = acquired
            try:
                seg = self._complete(
                    st.host,
                    rid,
                    prompt + tokens,
                    params,
                    params.max_new_tokens - len(tokens),
                    timeout_s=min(self.request_timeout_s, max(call.end - time.monotonic(), 0.1)),
                )
            except _RetryableError as e:
                errors.append(str(e))
                self._release(st, call, rid, failed_host=e.host_down)
                if time.monotonic() >= call.end:
                    raise VLLMError(
                        f"request {req.request_id!r}: generate() deadline passed; last: {e}"
                    ) from None
                if len(errors) > self.max_retries:
                    raise VLLMError(
                        f"request {req.request_id!r} failed {len(errors)} times; last: {e}"
                    ) from None
                continue
            except BaseException:
                self._release(st, call, rid)
                raise
            self._release(st, call, rid)
            segment += 1
            tokens += seg.token_ids
            logprobs += seg.logprobs
            versions += [version] * len(seg.token_ids)
            finish = seg.finish_reason
            if finish != "abort":
                break
            with self._cond:
                interrupted_by_update = st.update_epoch != epoch
                stopped = self._abort_epoch != call.abort_epoch or call.failed
            if stopped or not interrupted_by_update or self.update_mode != "continue":
                break
            finish = "length"  # resubmit the prefix on the new weights
        return Generation(
            request_id=req.request_id,
            token_ids=np.asarray(tokens, np.int32),
            logprobs=np.asarray(logprobs, np.float32),
            versions=np.asarray(versions, np.int32),
            finish_reason=finish,
        )

    def _acquire_host(
        self, request_id: str, rid: str, call: _Call, errors: list[str]
    ) -> tuple[_HostState, int, int] | None:
        """The least-loaded open healthy host with its version and update epoch (one in-flight
        slot taken, atomically with reading them), or None if the call was stopped."""
        with self._cond:
            while True:
                if self._aborted or self._abort_epoch != call.abort_epoch or call.failed:
                    return None
                if not any(st.healthy for st in self._hosts):
                    detail = f"; errors: {errors}" if errors else ""
                    raise VLLMError(
                        f"request {request_id!r}: no healthy vLLM host among "
                        f"{[self._describe_failed(st) for st in self._hosts]}{detail}"
                    )
                ready = [st for st in self._hosts if st.healthy and st.open]
                if ready and self._paused is None:
                    self._rr += 1
                    n = len(ready)
                    st = min(
                        (ready[(self._rr + i) % n] for i in range(n)), key=lambda s: s.inflight
                    )
                    st.inflight += 1
                    call.inflight[rid] = st.host
                    return st, st.version, st.update_epoch
                remaining = call.end - time.monotonic()
                if remaining <= 0:
                    state = f"paused ({self._paused})" if self._paused else "updating weights"
                    raise VLLMError(
                        f"request {request_id!r}: deadline passed while every vLLM host was "
                        f"{state}: {[st.host.url for st in self._hosts]}"
                    )
                self._cond.wait(timeout=min(remaining, 1.0))

    def _describe_failed(self, st: _HostState) -> str:
        return st.host.failure_message("unhealthy") if st.host.exit_code() else st.host.describe()

    def _release(self, st: _HostState, call: _Call, rid: str, failed_host: bool = False) -> None:
        with self._cond:
            st.inflight -= 1
            call.inflight.pop(rid, None)
            if failed_host:
                st.healthy = False
            self._cond.notify_all()

    def _complete(
        self,
        host: VLLMHost,
        vllm_request_id: str,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int,
        timeout_s: float,
    ) -> _Segment:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True,  # stop only on params.stop_token_ids (the model's EOS included)
            "seed": params.seed,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "request_id": vllm_request_id,
        }
        try:
            resp = _session().post(host.url + "/v1/completions", json=body, timeout=timeout_s)
        except requests.Timeout:
            self._abort_ids(host, [f"cmpl-{vllm_request_id}-0"])
            raise _RetryableError(
                host.failure_message(f"no answer within {timeout_s:.1f} s"), host_down=False
            ) from None
        except requests.RequestException as e:
            # A pooled keep-alive connection the server closed as it was reused fails the same
            # way as a dead host ("Remote end closed connection without response"): the host is
            # down only if its process exited or /health does not answer.
            down = not host.is_healthy(timeout_s=5.0)
            raise _RetryableError(
                host.failure_message(f"connection failed ({type(e).__name__}: {e})"),
                host_down=down,
            ) from None
        if resp.status_code >= 500:
            raise _RetryableError(
                host.failure_message(f"HTTP {resp.status_code}: {resp.text[:500]}"),
                host_down=host.exit_code() is not None,
            )
        if resp.status_code != 200:
            raise VLLMError(
                f"vLLM host {host.url} refused request {vllm_request_id!r} "
                f"(prompt {len(prompt)} tokens, max_tokens {max_tokens}): "
                f"HTTP {resp.status_code}: {resp.text[:500]}"
            )
        choice = resp.json()["choices"][0]
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs") or []
        names = lp.get("tokens") or []
        if len(logprobs) != len(token_ids) or names != [f"token_id:{t}" for t in token_ids]:
            raise VLLMError(
                f"vLLM host {host.url} answered request {vllm_request_id!r} with "
                f"{len(token_ids)} token ids but log-probs for {names[:8]}...; "
                "expected one log-prob per token id"
            )
        return _Segment(token_ids, [float(x) for x in logprobs], choice["finish_reason"])

    def _abort_ids(self, host: VLLMHost, ids: list[str]) -> None:
        try:
            _session().post(host.url + "/abort_requests", json={"request_ids": ids}, timeout=5)
        except requests.RequestException:
            pass

    def _abort_hosts(self, timeout_s: float, states: Sequence[_HostState] | None = None) -> bool:
        """Aborts requests on the hosts until none of this engine's calls is in flight."""
        states = self._hosts if states is None else states
        end = time.monotonic() + timeout_s
        while True:
            with self._cond:
                busy = [st for st in states if st.inflight > 0]
            if not busy:
                return True
            if time.monotonic() >= end:
                return False
            for st in busy:
                try:
                    _session().post(st.host.url + "/abort_requests", json={}, timeout=5)
                except requests.RequestException:
                    pass  # a dead host: its calls fail on their own
            with self._cond:
                self._cond.wait(timeout=0.05)

    def abort(self) -> None:
        """In-flight and later generate() calls return 'abort' partials until resume()."""
        with self._cond:
            self._aborted = True
            self._abort_epoch += 1
            self._cond.notify_all()
        self._abort_hosts(timeout_s=self.update_timeout_s)

    def pause(self, mode: str = "abort") -> None:
        """Stops dispatch; in-flight requests abort ('abort'), finish ('wait'), freeze ('keep')."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; valid: {PAUSE_MODES}")
        with self._cond:
            self._paused = mode
        if mode == "abort":
            self._abort_hosts(timeout_s=self.update_timeout_s)
        elif mode == "wait" and not self._wait_idle(self._hosts, self.update_timeout_s):
            raise VLLMError(
                f"pause('wait'): requests still in flight after {self.update_timeout_s} s: "
                f"{self.inflight()}"
            )
        elif mode == "keep":
            for st in self._hosts:
                self._post(st.host, "/pause?mode=keep")

    def resume(self) -> None:
        """Undoes abort() and pause(): frozen requests continue, waiting ones are dispatched."""
        if self._paused == "keep":
            for st in self._hosts:
                self._post(st.host, "/resume")
        with self._cond:
            self._paused = None
            self._aborted = False
            self._cond.notify_all()

    def stats(self) -> dict:
        """Generation busy time, calls, tokens, weight reloads, hosts healthy, pid."""
        with self._cond:
            healthy = sum(st.healthy for st in self._hosts)
        return {
            **self.clock.snapshot(),
            "updates": self.updates,
            "install_s": self.sync_s,
            "sync_s": self.sync_s,
            "hosts_healthy": healthy,
            "pid": os.getpid(),
        }

    def _wait_idle(self, states: Sequence[_HostState], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        with self._cond:
            while any(st.inflight > 0 for st in states):
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(timeout=min(remaining, 0.5))
        return True

    # -- weights -------------------------------------------------------------------------------

    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Reloads every host from the published HF directory of `weights`, as `version`.

        Returns when the hosts serve it. Raises VLLMError (hosts untouched) if the directory
        fails verify_weights_dir, or if no host loaded it; a host that fails alone is marked
        unhealthy and left out of dispatch. While paused with 'keep', in-flight requests are
        aborted (never drained) first.
        """
        path = os.path.abspath(Weights.of(weights).path())
        verify_weights_dir(path, version, checksums=self.verify_checksums)
        tied = ties_word_embeddings(path)
        with self._update_lock:
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(len(self._hosts)) as pool:
                results = list(
                    pool.map(lambda st: self._update_host(st, version, path, tied), self._hosts)
                )
            failed = [err for err in results if err is not None]
            if len(failed) == len(self._hosts):
                raise VLLMError(
                    f"no vLLM host loaded version {version} from {path}:\n" + "\n".join(failed)
                )
            for err in failed:
                log.error("weight update to version %d failed: %s", version, err)
            with self._cond:
                self.version = version
            took = time.monotonic() - t0
            self.updates += 1
            self.sync_s += took
            log.info("vLLM hosts serve version %d (%s) after %.2f s", version, path, took)
        return WeightUpdate.served(version)

    def _update_host(self, st: _HostState, version: int, path: str, tied: bool) -> str | None:
        """One host: gate, empty, pause, reload, re-tie, set version, resume. Error or None."""
        with self._cond:
            st.open = False
            st.update_epoch += 1
            keep_paused = self._paused == "keep"
        try:
            drained = False
            if self.update_mode == "drain" and not keep_paused:
                drained = self._wait_idle([st], self.update_timeout_s)
            if not drained and not self._abort_hosts(self.update_timeout_s, [st]):
                raise VLLMError(f"in-flight requests did not end within {self.update_timeout_s} s")
            for attempt in range(self.max_retries + 1):
                try:
                    self._reload(st.host, version, path, tied)
                    break
                except VLLMError:
                    if attempt == self.max_retries or st.host.exit_code() is not None:
                        raise
                    log.warning("reload on %s failed; retrying", st.host.url, exc_info=True)
        except VLLMError as e:
            with self._cond:
                st.healthy = False  # unknown weights: never dispatch to it until fixed
                st.open = True
                self._cond.notify_all()
            return str(e)
        with self._cond:
            st.version = version
            st.healthy = True
            st.open = True
            self._cond.notify_all()
        return None

    def _reload(self, host: VLLMHost, version: int, path: str, tied: bool) -> None:
        self._post(host, "/pause?mode=abort")
        try:
            self._post(
                host,
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": path}},
            )
            if tied:
                try:
                    out = self._post(
                        host, "/collective_rpc", {"method": "tandem_retie_word_embeddings"}
                    )
                except VLLMError as e:
                    raise VLLMError(
                        f"{e}\n(a tied-embedding model needs the server started with "
                        f"--worker-extension-cls {WORKER_EXTENSION}; VLLMHost.launch does that)"
                    ) from None
                results = (out or {}).get("results", [])
                if not results or not all(r.get("shared") for r in results if r.get("tied")):
                    raise VLLMError(
                        host.failure_message(f"re-tying lm_head to embed_tokens failed: {out}")
                    )
            self._set_server_version(host, version)
            self._post(host, "/reset_prefix_cache")
        finally:
            try:
                self._post(host, "/resume")
            except VLLMError as e:
                log.warning("resume failed: %s", e)

    def _set_server_version(self, host: VLLMHost, version: int) -> None:
        self._post(host, "/update_weight_version", {"new_version": str(version)})
        served = (self._get(host, "/weight_info") or {}).get("weight_version")
        if served != str(version):
            msg = f"reports weight_version {served!r}, not {version}"
            raise VLLMError(host.failure_message(msg))

    def _post(self, host: VLLMHost, route: str, body: dict | None = None):
        return self._call("post", host, route, body)

    def _get(self, host: VLLMHost, route: str):
        return self._call("get", host, route, None)

    def _call(self, method: str, host: VLLMHost, route: str, body: dict | None):
        try:
            resp = getattr(_session(), method)(
                host.url + route, json=body, timeout=self.update_timeout_s
            )
        except requests.RequestException as e:
            raise VLLMError(host.failure_message(f"{route} failed ({type(e).__name__})")) from None
        if resp.status_code != 200:
            hint = ""
            if resp.status_code == 404 and route == "/collective_rpc":
                hint = " (start the server with VLLM_SERVER_DEV_MODE=1)"
            raise VLLMError(
                host.failure_message(
                    f"{route} answered HTTP {resp.status_code}{hint}: {resp.text[:500]}"
                )
            )
        return resp.json() if resp.content else None

    def close(self) -> None:
        """Stops dispatch and, if the engine owns its hosts, stops their servers."""
        self.abort()
        self._pool.shutdown(wait=True)
        if self.owns_hosts:
            for st in self._hosts:
                st.host.stop()


class _RetryableError(Exception):
    def __init__(self, message: str, host_down: bool):
        super().__init__(message)
        self.host_down = host_down
