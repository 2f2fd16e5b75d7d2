"""THE rollout engine contract: token ids in; token ids, behavior log-probs and versions out.

Every engine follows it (the in-process JAX sampler, the sampler in its own process, vLLM hosts,
the Ray worker pool), so the trainer never asks which kind it holds:

  generate(requests) -> [Generation]     blocks until every request finished or was aborted
  update_weights(version, weights) -> WeightUpdate
                                         the engine serves `version` once the handle is done;
                                         drain or continue was fixed when the engine was built
  abort() / resume()                     in-flight and later generations return 'abort'
                                         partials until resume()
  stats() -> dict                        counters: busy_s, tokens, generate_calls, updates,
                                         install_s, pid (plus engine-specific numbers)
  close()                                releases processes, servers, threads; idempotent
  warm(prompt_len, max_new_tokens) -> int
                                         compiles ahead what such requests run: the programs
                                         compiled (0 where nothing compiles ahead)
  record_timeline() -> list | None       the list the scheduler records its calls in from now
                                         on (diagnostics); None where it runs out of process

tests/test_engine_contract.py runs every engine through the same cases.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

UPDATE_MODES = ("drain", "continue", "inflight")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete; prompt_ids is an int32 array of token ids."""

    request_id: str
    prompt_ids: np.ndarray
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Generation:
    """A completion: per-token ids, behavior log-probs and the policy version that made each."""

    request_id: str
    token_ids: np.ndarray  # int32 [N]
    logprobs: np.ndarray  # float32 [N], log p(token) under the sampling distribution
    versions: np.ndarray  # int32 [N]
    finish_reason: str  # "stop" | "length" | "abort"


class RolloutError(RuntimeError):
    """A rollout engine or worker failed in a way the run cannot recover from."""


class WorkerLost(RuntimeError):
    """A rollout worker died or stopped answering; its work can be re-dispatched."""


class Weights:
    """One policy version's weights, in whichever form an engine serves from.

    Give any of: `params` (a params tree, e.g. on the learner's devices), `flat` ({path: numpy
    array}), `path` (a published HF directory), `ref` (a Ray ObjectRef of `flat`); or makers
    (`make_path`, `make_ref`) called at most once, when an engine first asks for that form.
    """

    def __init__(
        self,
        *,
        params=None,
        flat: dict | None = None,
        path: str | None = None,
        ref=None,
        make_path: Callable[[], str] | None = None,
        make_ref: Callable[[], Any] | None = None,
    ):
        if all(x is None for x in (params, flat, path, ref, make_path, make_ref)):
            raise ValueError("Weights needs params, flat, path or ref (or a maker of one)")
        self._params, self._flat, self._path, self._ref = params, flat, path, ref
        self._make_path, self._make_ref = make_path, make_ref
        self._lock = threading.RLock()

    @classmethod
    def of(cls, weights) -> Weights:
        """`weights` as Weights: a Weights, an HF directory path, a flat dict or a params tree."""
        if isinstance(weights, Weights):
            return weights
        if isinstance(weights, str):
            return cls(path=weights)
        if isinstance(weights, dict) and all(isinstance(v, np.ndarray) for v in weights.values()):
            return cls(flat=weights)
        return cls(params=weights)

    def publish_with(self, server, version: int) -> Weights:
        """These weights, with path() written by `server` (a ParamServer) as `version`."""
        with self._lock:
            if self._make_path is None and self._path is None:
                self._make_path = lambda: server.write(version, self.tree(None))[0]
        return self

    def in_memory(self) -> bool:
        """Whether the weights exist as arrays (params, flat or ref), not only as a directory."""
        return any(x is not None for x in (self._params, self._flat, self._ref, self._make_ref))

    def tree(self, template):
        """The params as a tree shaped like `template` (loaded or filled if needed)."""
        from flax import nnx

        if self._params is not None:
            p = self._params
            return nnx.state(p, nnx.Param) if isinstance(p, nnx.Module) else p
        if self._flat is None and self._ref is None and self._path is not None:
            from models import load_hf

            return nnx.state(load_hf(self._path), nnx.Param)
        from models.params import fill_params

        return fill_params(template, self.flat())

    def flat(self) -> dict[str, np.ndarray]:
        """The params as {path: numpy array} (a host copy, made once)."""
        with self._lock:
            if self._flat is None:
                if self._params is not None:
                    from models.params import flat_params

                    self._flat = flat_params(self._params)
                elif self._ref is not None or self._make_ref is not None:
                    import ray

                    self._flat = ray.get(self._ref_locked())
                else:
                    raise ValueError("these weights exist only as an HF directory: use path()")
            return self._flat

    def path(self) -> str:
        """A published HF directory of these weights (written once, by make_path)."""
        with self._lock:
            if self._path is None:
                if self._make_path is None:
                    raise ValueError("no HF directory for these weights (give path or make_path)")
                self._path = self._make_path()
            return self._path

    def rewrite(self) -> str | None:
        """Writes path() again with make_path (the published directory was found damaged);
        None if these weights came as a directory, with no maker to write it again."""
        with self._lock:
            if self._make_path is None:
                return None
            self._path = self._make_path()
            return self._path

    def ref(self):
        """A Ray ObjectRef of flat() (put once, or made by make_ref)."""
        with self._lock:
            return self._ref_locked()

    def _ref_locked(self):
        if self._ref is None:
            if self._make_ref is not None:
                self._ref = self._make_ref()
            else:
                import ray

                self._ref = ray.put(self.flat())
        return self._ref


class WeightUpdate:
    """A weight update in flight: wait() for it, or then(on_served, on_error)."""

    def __init__(self, version: int):
        self.version = version
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._callbacks: list[tuple[Callable, Callable | None]] = []

    @classmethod
    def served(cls, version: int) -> WeightUpdate:
        """An update that is already done."""
        u = cls(version)
        u.set_served()
        return u

    def set_served(self) -> None:
        """Called by the engine once it serves the version."""
        self._finish(None)

    def set_failed(self, error: BaseException) -> None:
        """Called by the engine if it cannot serve the version."""
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for on_served, on_error in callbacks:
            self._call(on_served, on_error)

    def _call(self, on_served, on_error) -> None:
        if self._error is None:
            on_served(self.version)
        elif on_error is not None:
            on_error(self._error)

    def done(self) -> bool:
        """Whether the engine serves the version (or failed to)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the engine serves the version; raises its error, or TimeoutError."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"weight update to version {self.version}: not served in {timeout}s")
        if self._error is not None:
            raise self._error

    def then(self, on_served: Callable[[int], Any], on_error: Callable | None = None) -> None:
        """Calls on_served(version) once served, or on_error(exception); at once if done."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append((on_served, on_error))
                return
        self._call(on_served, on_error)


@runtime_checkable
class Engine(Protocol):
    """What the trainer needs from a rollout engine (see the module docstring)."""

    version: int

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Completes every request; blocks until all are finished or aborted."""
        ...

    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Starts serving `weights` (Weights, or anything Weights.of takes) as `version`."""
        ...

    def abort(self) -> None:
        """In-flight and later generate() calls return 'abort' partials until resume()."""
        ...

    def resume(self) -> None:
        """Undoes abort()."""
        ...

    def stats(self) -> dict:
        """The engine's counters (busy_s, tokens, generate_calls, updates, install_s, pid)."""
        ...

    def close(self) -> None:
        """Releases the engine's resources; idempotent."""
        ...

    def warm(self, prompt_len: int, max_new_tokens: int, *, truncate: bool = False) -> int:
        """Compiles ahead what requests of at most these lengths run (top-k / top-p: truncate);
        the programs compiled, 0 where nothing compiles ahead (vLLM compiles at launch)."""
        ...

    def record_timeline(self) -> list | None:
        """Starts recording the scheduler's calls into the list returned (diagnostics: the
        in-process JAX sampler's); None where the scheduler runs in another process."""
        ...
