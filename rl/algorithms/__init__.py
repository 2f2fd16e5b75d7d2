"""Advantage estimators and policy losses, registered by name so configs can pick them."""

from rl.algorithms.advantages import (
    ADVANTAGES,
    AdvantageSpec,
    advantage_spec,
    compute_advantages,
    register_advantage,
)
from rl.algorithms.losses import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    LOG_RATIO_CLIP,
    LOSSES,
    LossConfig,
    LossInputs,
    LossSpec,
    TokenTerms,
    aggregate,
    compute_loss,
    loss_spec,
    needs_proximal,
    policy_losses,
    register_loss,
    token_level,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "IS_CORRECTIONS",
    "LOG_RATIO_CLIP",
    "LOSSES",
    "AdvantageSpec",
    "LossConfig",
    "LossInputs",
    "LossSpec",
    "TokenTerms",
    "advantage_spec",
    "aggregate",
    "compute_advantages",
    "compute_loss",
    "loss_spec",
    "needs_proximal",
    "policy_losses",
    "register_advantage",
    "register_loss",
    "token_level",
]
