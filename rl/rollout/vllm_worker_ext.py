"""vLLM worker extension: methods callable by name through the server's POST /collective_rpc,
and the registration of Tandem's weight-transfer engine.

Loaded inside each vLLM worker process with `--worker-extension-cls
rl.rollout.vllm_worker_ext.TandemWorkerExtension` (the project root must be on PYTHONPATH).
It runs in vLLM's worker, not in the trainer: it imports only the worker-side modules
rl/rollout/vllm_weight_engine.py and rl/rollout/weight_wire.py, and those only when used.

Why it exists: in vLLM 0.32/0.33, `reload_weights` on a model with tied word embeddings
reloads the body but leaves `lm_head` computing with the OLD weights ("ParallelLMHead: Failed
to load weights"). On CPU the lm_head GEMM packs its weight at load time, so re-sharing the
parameter is not enough: its `process_weights_after_loading` must run again. And vLLM creates a
weight-transfer engine by its registered name after the worker class (with this extension) is
imported, so registering "tandem" here makes `--weight-transfer-config '{"backend": "tandem"}'`
valid in every worker (rl/rollout/vllm_weight_engine.py).
"""

from __future__ import annotations


def _register_weight_engine() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            "tandem", "rl.rollout.vllm_weight_engine", "TandemWeightTransferEngine"
        )
    except ValueError:  # already registered in this process
        pass


_register_weight_engine()


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class; `self` is the worker."""

    def tandem_retie_word_embeddings(self) -> dict:
        """Re-shares lm_head with embed_tokens after a reload when the model ties them."""
        from rl.rollout.vllm_weight_engine import retie_word_embeddings

        model = self.model_runner.get_model()
        return retie_word_embeddings(model, self.model_runner.model_config.hf_config)
