"""The learner contract (rl.learner.LearnerHandle): every implementation (the Learner in this
process, the lockstep leader, the Ray learner client) takes each of its calls as the trainer
makes them, and the in-process one keeps it: a checkpoint saved with its groups and partial
groups comes back from restore(), with the version."""

import inspect

import jax
import pytest
from test_partials import _assert_equal, _partials

from rl import config as C
from rl.learner import Learner, LearnerHandle
from rl.learner_setup import make_learner
from rl.lockstep import Leader
from rl.ray.learner import RemoteLearner

# Each call of the contract as the trainer and the warm start make it: (args, keywords).
CALLS = {
    "update": (("batch",), {"minibatches": 2}),
    "set_step_cfg": (("step_cfg",), {}),
    "reset_optimizer": (("tx",), {}),
    "weights": ((), {}),
    "save": ((3, {"step": 3}, {}, {}), {}),
    "wait_saved": ((), {}),
    "restore": ((), {}),
    "restart": (("why",), {}),
    "stats": ((), {}),
    "close": ((), {"failed": True}),
}


@pytest.mark.parametrize("impl", [Learner, Leader, RemoteLearner], ids=lambda c: c.__name__)
def test_every_learner_takes_the_contracts_calls(impl):
    for name, (args, kwargs) in CALLS.items():
        assert callable(getattr(LearnerHandle, name)), name
        inspect.signature(getattr(impl, name)).bind(object(), *args, **kwargs)


def test_the_learner_in_this_process_saves_and_restores_through_the_contract(tmp_path):
    cfg = C.load(None, ["trainer.async_checkpoint=true"])
    run_dir = str(tmp_path / "run")
    _, learner, _ = make_learner(cfg, 64, jax.devices(), run_dir)
    parts = _partials()
    try:
        assert learner.restore() is None  # no checkpoint yet
        learner.version = 3
        learner.save(3, {"step": 3, "version": 3}, {}, parts)
        learner.wait_saved()
        assert learner.stats() == {} and learner.restarts == 0
        with pytest.raises(RuntimeError, match="lost; a learner in this process is not"):
            learner.restart("lost")
    finally:
        learner.close()
    _, again, _ = make_learner(cfg, 64, jax.devices(), run_dir)
    try:
        meta, groups, back = again.restore()
        assert again.version == 3 and meta == {"step": 3, "version": 3} and groups == {}
        _assert_equal(parts, back)
    finally:
        again.close(failed=False)
