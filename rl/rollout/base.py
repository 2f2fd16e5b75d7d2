"""The rollout engine protocol: token ids in, token ids + log-probs + versions out."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


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


class Engine(Protocol):
    """What the trainer needs from a rollout engine (jax sampler, vLLM hosts)."""

    version: int

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Completes every request; blocks until all are finished or aborted."""
        ...

    def abort(self) -> None:
        """Makes an in-flight generate() return early with finish_reason 'abort'."""
        ...

    def update_weights(self, version: int, path: str | None = None, params=None) -> None:
        """Loads new weights (an HF directory or an in-memory params tree) as `version`."""
        ...

    def close(self) -> None:
        """Releases the engine's resources."""
        ...
