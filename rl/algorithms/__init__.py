"""Advantage estimators and policy losses, registered by name so configs can pick them."""

from rl.algorithms.advantages import ADVANTAGES, compute_advantages, register_advantage
from rl.algorithms.losses import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    LOG_RATIO_CLIP,
    LOSSES,
    LossConfig,
    LossInputs,
    TokenTerms,
    aggregate,
    compute_loss,
    register_loss,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "IS_CORRECTIONS",
    "LOG_RATIO_CLIP",
    "LOSSES",
    "LossConfig",
    "LossInputs",
    "TokenTerms",
    "aggregate",
    "compute_advantages",
    "compute_loss",
    "register_advantage",
    "register_loss",
]
