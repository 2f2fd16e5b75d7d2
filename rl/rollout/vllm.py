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
whose connection fails, or that leaves a request unanswered past its timeout and then /health
too (a hung host), is marked unhealthy and its requests go to the others; a weight update skips
a host whose /health does not answer (and takes it back once it does). When no host is healthy
generate() raises VLLMError naming each host, its exit code and its log tail. A published
directory that fails its manifest check is written again once by its maker (Weights.rewrite)
before the update gives up.
generate() may be called from many threads at once; update_weights() from another.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import requests

from rl.metrics import BusyClock
from rl.rollout.base import Generation, GenerationRequest, SamplingParams, Weights, WeightUpdate
from rl.rollout.vllm_host import (
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION,
    VLLMError,
    VLLMHost,
    VLLMHostsDown,
    http_session,
    launch_hosts,
    ties_word_embeddings,
    verify_weights_dir,
)

if TYPE_CHECKING:  # the streamer brings JAX; an engine without one does not need it
    from rl.rollout.weight_stream import Prepared, Snapshot, WeightStreamer

log = logging.getLogger(__name__)

UPDATE_MODES = ("drain", "abort", "continue")
HEALTH_PROBE_S = 5.0  # how long a /health probe of a host that may be hung waits
PAUSE_MODES = ("abort", "wait", "keep")


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
        streamer: WeightStreamer | None = None,
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
        self.streamer = streamer  # weights in memory go straight to the workers (no directory)
        self._updates = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-update")
        self.last_update: dict = {}  # what the last direct update sent and how long it took
        self._cond = threading.Condition()
        self._update_lock = threading.Lock()
        self._paused: str | None = None
        self._aborted = False  # abort() until resume(): every generation returns 'abort'
        self._abort_epoch = 0
        self.clock = BusyClock()
        self.updates = 0
        self.streamed = 0  # of those, streamed (weight_sync direct) rather than reloaded
        self.sync_s = 0.0
        self.refused: list[str] = []  # published directories refused (and written again)
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
                    raise VLLMHostsDown(
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
            resp = http_session().post(host.url + "/v1/completions", json=body, timeout=timeout_s)
        except requests.Timeout:
            # a host that answers neither the request nor /health is hung (stopped, wedged)
            down = not host.is_healthy(timeout_s=HEALTH_PROBE_S)
            if not down:
                self._abort_ids(host, [f"cmpl-{vllm_request_id}-0"])
            what = f"no answer within {timeout_s:.1f} s" + (", nor to /health" if down else "")
            raise _RetryableError(host.failure_message(what), host_down=down) from None
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
            http_session().post(host.url + "/abort_requests", json={"request_ids": ids}, timeout=5)
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
                    http_session().post(st.host.url + "/abort_requests", json={}, timeout=5)
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
            "streamed": self.streamed,
            "install_s": self.sync_s,
            "sync_s": self.sync_s,
            "hosts_healthy": healthy,
            "pid": os.getpid(),
        }

    def warm(self, prompt_len: int, max_new_tokens: int, *, truncate: bool = False) -> int:
        """0: a vLLM server compiles (and captures its graphs) at launch."""
        return 0

    def record_timeline(self) -> None:
        """None: the scheduler runs in the vLLM servers."""
        return None

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

        Returns when the hosts serve it. A directory that fails verify_weights_dir is written
        again once if `weights` can (Weights.rewrite); raises VLLMError (hosts untouched) if it
        still fails, or if no host loaded it. A host that fails alone, or whose /health does not
        answer, is marked unhealthy and left out of dispatch until an update reloads it.
        While paused with 'keep', in-flight requests are aborted (never drained) first.
        """
        w = Weights.of(weights)
        if self.streamer is not None and w.in_memory():
            return self._update_direct(version, w)
        path = os.path.abspath(w.path())
        try:
            verify_weights_dir(path, version, checksums=self.verify_checksums)
        except VLLMError as e:
            again = w.rewrite()  # damaged after it was written: publish it once more
            if again is None:
                raise
            log.warning("version %d refused (%s); published again", version, e)
            self.refused.append(str(e))
            path = os.path.abspath(again)
            verify_weights_dir(path, version, checksums=self.verify_checksums)
        tied = ties_word_embeddings(path)
        with self._update_lock:
            reload = lambda st, host: self._reload(host, version, path, tied)  # noqa: E731
            took = self._update_all(version, reload, f" from {path}")
            log.info("vLLM hosts serve version %d (%s) after %.2f s", version, path, took)
        return WeightUpdate.served(version)

    def _update_all(self, version: int, load, source: str = "") -> float:
        """Every host through _update_host with load(state, host), in parallel (the caller holds
        _update_lock). Raises VLLMError when none loaded `version`; the engine serves it once
        one has. Returns the seconds taken."""
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(self._hosts)) as pool:
            results = list(
                pool.map(
                    lambda st: self._update_host(st, version, lambda host: load(st, host)),
                    self._hosts,
                )
            )
        failed = [err for err in results if err is not None]
        if len(failed) == len(self._hosts):
            raise VLLMError(f"no vLLM host loaded version {version}{source}:\n" + "\n".join(failed))
        for err in failed:
            log.error("weight update to version %d failed: %s", version, err)
        with self._cond:
            self.version = version
        took = time.monotonic() - t0
        self.updates += 1
        self.sync_s += took
        return took

    def _update_host(self, st: _HostState, version: int, load) -> str | None:
        """One host: gate, empty, then load(host) (pause, load, set version, resume). Error or
        None."""
        with self._cond:
            st.open = False
            st.update_epoch += 1
            keep_paused = self._paused == "keep"
        try:
            if not st.host.is_healthy(timeout_s=HEALTH_PROBE_S):  # dead or hung: skip it
                raise VLLMError(st.host.failure_message("/health did not answer; not reloaded"))
            drained = False
            if self.update_mode == "drain" and not keep_paused:
                drained = self._wait_idle([st], self.update_timeout_s)
            if not drained and not self._abort_hosts(self.update_timeout_s, [st]):
                raise VLLMError(f"in-flight requests did not end within {self.update_timeout_s} s")
            for attempt in range(self.max_retries + 1):
                try:
                    load(st.host)
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

    def _update_direct(self, version: int, w: Weights) -> WeightUpdate:
        """Streams in-memory weights to every host (rl/rollout/weight_stream.py); returns once
        the serving-dtype copy is dispatched, and the handle is served when the hosts are."""
        snap = self.streamer.snapshot(w.tree(self.streamer.template))
        update = WeightUpdate(version)
        self._updates.submit(self._run_direct, version, snap, update)
        return update

    def _run_direct(self, version: int, snap: Snapshot, update: WeightUpdate) -> None:
        prepared = None
        try:
            with self._update_lock:
                t0 = time.monotonic()
                prepared = self.streamer.begin(snap, version)
                sent: dict[str, dict] = {}
                self._update_all(version, lambda st, host: self._stream(st, host, prepared, sent))
                self.streamer.finish(prepared, served=True)
                self.streamed += 1
                took = time.monotonic() - t0  # the encoding included
                self.last_update = {
                    "version": version,
                    "seconds": took,
                    "bytes": prepared.nbytes,
                    "hosts": sent,
                    **self.streamer.stats,
                }
                log.info("vLLM hosts serve version %d (streamed) after %.2f s", version, took)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the handle
            if prepared is not None:
                self.streamer.finish(prepared, served=False)
            update.set_failed(e)
            return
        update.set_served()
        self.streamer.record_later(prepared)

    def _stream(self, st: _HostState, host: VLLMHost, prepared: Prepared, sent: dict) -> None:
        """One host's update through vLLM's weight-transfer endpoints; a delta the host cannot
        apply (it missed one, or its check failed) is sent again whole."""
        kind, payload = self.streamer.payload(st.version)
        self._post(host, "/pause?mode=abort")
        try:
            t0 = time.monotonic()
            try:
                self._transfer(host, kind)
            except VLLMError as e:
                if kind == "full":
                    raise
                log.warning(
                    "delta to %s refused; sending version %d whole: %s",
                    host.url,
                    prepared.version,
                    e,
                )
                kind, payload = "full", self.streamer.payload(-1)[1]
                self._transfer(host, kind)
            served = (self._get(host, "/weight_info") or {}).get("weight_version")
            if served != str(prepared.version):
                raise VLLMError(
                    host.failure_message(
                        f"reports weight_version {served!r}, not {prepared.version}"
                    )
                )
            self._post(host, "/reset_prefix_cache")
            sent[host.url] = {
                "kind": kind,
                "bytes": payload.nbytes,
                "changed": payload.changed,
                "elements": payload.elements,
                "seconds": time.monotonic() - t0,
            }
        finally:
            try:
                self._post(host, "/resume")
            except VLLMError as e:
                log.warning("resume failed: %s", e)

    def _transfer(self, host: VLLMHost, kind: str) -> None:
        info = self.streamer.update_info(host.url, kind)
        self._post(host, "/start_weight_update")
        try:
            self._post(host, "/update_weights", {"update_info": info})
        except VLLMError as e:
            raise VLLMError(
                f"{e}\n(the server needs --weight-transfer-config "
                f'\'{{"backend": "{WEIGHT_TRANSFER_BACKEND}"}}\' and --worker-extension-cls '
                f"{WORKER_EXTENSION}; VLLMHost.launch passes both)"
            ) from None
        self._post(host, "/finish_weight_update", {"weight_version": str(info["version"])})

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
            if self.streamer is not None:  # a directory reload starts the streamed versions anew
                self._post(host, "/shutdown_weight_transfer_engine")
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
        for attempt in range(2):
            try:
                resp = getattr(http_session(), method)(
                    host.url + route, json=body, timeout=self.update_timeout_s
                )
                break
            except requests.ConnectionError as e:
                # The server may close a kept-alive connection after an error answer; the next
                # call on it fails unsent. Once more on a new connection, unless the host died.
                if attempt == 0 and host.exit_code() is None:
                    log.warning("%s%s: %s; once more on a new connection", host.url, route, e)
                    continue
                raise VLLMError(
                    host.failure_message(f"{route} failed ({type(e).__name__})")
                ) from None
            except requests.RequestException as e:
                raise VLLMError(
                    host.failure_message(f"{route} failed ({type(e).__name__})")
                ) from None
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
        self._updates.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self.streamer is not None:
            self.streamer.close()
        if self.owns_hosts:
            for st in self._hosts:
                st.host.stop()


class _RetryableError(Exception):
    def __init__(self, message: str, host_down: bool):
        super().__init__(message)
        self.host_down = host_down


def launch_engine(
    path: str,
    log_paths: list[str],
    *,
    version: int,
    launch: dict,
    engine: dict,
    die_with_parent: bool = False,
) -> VLLMEngine:
    """A VLLMEngine owning len(log_paths) vLLM servers launched here on the HF directory `path`
    (`launch`: launch_hosts keywords; `engine`: VLLMEngine keywords)."""
    hosts = launch_hosts(path, log_paths, die_with_parent=die_with_parent, **launch)
    return VLLMEngine(hosts, version=version, owns_hosts=True, **engine)
