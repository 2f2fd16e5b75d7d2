"""vLLM worker extension: methods callable by name through the server's POST /collective_rpc.

Loaded inside each vLLM worker process with `--worker-extension-cls
rl.rollout.vllm_worker_ext.TandemWorkerExtension` (the project root must be on PYTHONPATH).
It must not import anything from this project: it runs in vLLM's worker, not in the trainer.

Why it exists: in vLLM 0.32/0.33, `reload_weights` on a model with tied word embeddings
reloads the body but leaves `lm_head` computing with the OLD weights ("ParallelLMHead: Failed
to load weights"). On CPU the lm_head GEMM packs its weight at load time, so re-sharing the
parameter is not enough: its `process_weights_after_loading` must run again.
"""

from __future__ import annotations


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class; `self` is the worker."""

    def tandem_retie_word_embeddings(self) -> dict:
        """Re-shares lm_head with embed_tokens after a reload when the model ties them."""
        import torch

        model = self.model_runner.get_model()
        hf_config = self.model_runner.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        tied = bool(getattr(text_config, "tie_word_embeddings", False))
        if not tied:
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
