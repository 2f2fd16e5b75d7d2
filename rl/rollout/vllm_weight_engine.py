"""The receiving side of Tandem's direct weight path: a vLLM weight-transfer engine ("tandem").

It plugs into vLLM's own weight-update machinery (vllm/distributed/weight_transfer): the server
is started with `--weight-transfer-config '{"backend": "tandem"}'`, the worker extension
(rl/rollout/vllm_worker_ext.py) registers this class under that name when vLLM imports it, and
the trainer drives vLLM's endpoints `POST /start_weight_update`, `/update_weights`,
`/finish_weight_update` (rl/rollout/weight_stream.py). vLLM has no CPU transport (its `nccl`,
`ipc` and `sparse_nccl` backends need CUDA), so the bytes come through a shared-memory file or a
TCP socket (rl/rollout/weight_wire.py).

One update is one `/update_weights` call. Every tensor is decoded and its checksum verified
before the model is touched; only then are the weights loaded with vLLM's in-place reload
(layerwise: every layer's weights are processed again, as the CPU GEMMs pack them at load).
A refused update leaves the model on the version it served. Versions only go up, and a delta
must name the version this host holds as its base; otherwise the update is refused and the
trainer sends the full version.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rl.rollout import weight_wire

logger = init_logger(__name__)

BACKEND = "tandem"
NEEDS_FULL = "needs the full version"  # in the error of a delta this host cannot apply


@dataclasses.dataclass
class TandemInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: each update says where its bytes are."""


@dataclasses.dataclass
class TandemUpdateInfo(WeightTransferUpdateInfo):
    """One version: where its payload is, the table of its tensors, and its base version."""

    version: int
    transport: str  # "shm" (location: a file path) or "tcp" (location: host:port)
    location: str
    nbytes: int
    tensors: list[dict]
    base_version: int | None = None  # the version deltas apply to; None: every tensor is whole
    keep_base: bool = False  # keep a copy of this version for the next update's deltas
    token: str = ""
    timeout_s: float = 120.0


class TandemWeightTransferEngine(WeightTransferEngine[TandemInitInfo, TandemUpdateInfo]):
    """Receives a version through shared memory or a socket, verifies it, loads it in place."""

    init_info_cls = TandemInitInfo
    update_info_cls = TandemUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version: int | None = None  # the last version loaded through this engine
        self.base: dict[str, np.ndarray] = {}  # this version's tensors, when kept for deltas
        self.base_version: int | None = None

    def init_transfer_engine(self, init_info: TandemInitInfo) -> None:
        """Nothing to set up."""

    def start_weight_update(self) -> None:
        """Nothing: the model is touched only once the whole update is verified."""

    def finish_weight_update(self) -> None:
        """Nothing: receive_weights loaded and processed every layer."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receives one version (no device sync: the CPU worker has no accelerator)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: TandemUpdateInfo) -> None:
        """Reads, decodes and verifies every tensor, then reloads the model from them."""
        t0 = time.perf_counter()
        if self.version is not None and info.version <= self.version:
            raise ValueError(
                f"weight version {info.version} arrived after version {self.version}: versions "
                "only go up (an out-of-order or repeated update)"
            )
        delta = any(e["encoding"] != "full" for e in info.tensors)
        if delta and (info.base_version is None or info.base_version != self.base_version):
            raise ValueError(
                f"version {info.version} is a delta on version {info.base_version}, but this "
                f"host holds version {self.base_version} as its base: it {NEEDS_FULL}"
            )
        payload = self._read(info)
        t1 = time.perf_counter()
        base = self.base if info.base_version == self.base_version else {}
        self.base, self.base_version = {}, None  # patched in place below: invalid until verified
        tensors: dict[str, np.ndarray] = {}
        for entry in info.tensors:
            name = entry["name"]
            tensor = weight_wire.decode(entry, payload, base.get(name))
            if info.keep_base and entry["encoding"] == "full":  # the payload is reused: copy
                tensor = _copy_into(base.get(name), tensor)
            tensors[name] = tensor
        t2 = time.perf_counter()
        self._load(tensors)
        del payload  # unmaps a shared-memory payload once no tensor views it
        self.version = info.version
        if info.keep_base:
            self.base, self.base_version = tensors, info.version
        logger.info(
            "tandem weights v%d (%s, %d tensors, %d of them deltas, %.1f MB): read %.3f s, "
            "decode+verify %.3f s, load %.3f s",
            info.version,
            info.transport,
            len(info.tensors),
            sum(e["encoding"] != "full" for e in info.tensors),
            info.nbytes / 1e6,
            t1 - t0,
            t2 - t1,
            time.perf_counter() - t2,
        )

    def _read(self, info: TandemUpdateInfo) -> memoryview:
        if info.transport == "shm":
            return weight_wire.read_shm(info.location, info.nbytes)
        if info.transport == "tcp":
            return weight_wire.read_socket(info.location, info.token, info.nbytes, info.timeout_s)
        raise ValueError(f"transport {info.transport!r}; valid: 'shm', 'tcp'")

    def _load(self, tensors: dict[str, np.ndarray]) -> None:
        """vLLM's in-place reload from checkpoint-format tensors, then re-tying lm_head."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = [(name, as_torch(t)) for name, t in tensors.items()]
        reload_weights(
            self.vllm_config,
            self.model,
            weights_iterator=weights,
            weights_path=None,
            is_checkpoint_format=True,
        )
        retie_word_embeddings(self.model, self.model_config.hf_config)

    def shutdown(self) -> None:
        """Drops the kept base and the version order: the next update must be whole, any
        version (the trainer calls this after a reload from a directory, e.g. a new run)."""
        self.base, self.base_version = {}, None
        self.version = None


def as_torch(array: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array (bfloat16 through its bits: torch does not read ml_dtypes)."""
    if array.dtype == np.dtype("bfloat16"):
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _copy_into(out: np.ndarray | None, tensor: np.ndarray) -> np.ndarray:
    """tensor copied into `out` when shapes and dtypes agree (reusing its memory), else a copy."""
    if out is not None and out.shape == tensor.shape and out.dtype == tensor.dtype:
        if out is not tensor:
            np.copyto(out, tensor)
        return out
    return np.array(tensor, copy=True)


def retie_word_embeddings(model, hf_config) -> dict:
    """Re-shares lm_head with embed_tokens after a reload when the model ties them.

    vLLM 0.32/0.33's in-place reload leaves a tied lm_head on its OLD weights; on CPU the lm_head
    GEMM packs its weight at load time, so its process_weights_after_loading must run again."""
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if not bool(getattr(text_config, "tie_word_embeddings", False)):
        return {"tied": False}
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None:
        raise RuntimeError(
            f"{type(model).__name__} ties word embeddings but has no lm_head or "
            "model.embed_tokens; Tandem's re-tie supports Qwen2/Qwen3/Llama layouts"
        )
    with torch.no_grad():
        lm_head.weight = embed.weight
        lm_head.quant_method.process_weights_after_loading(lm_head)
    return {"tied": True, "shared": lm_head.weight is embed.weight}
