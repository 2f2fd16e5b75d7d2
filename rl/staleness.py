"""Adaptive staleness: the admission bound eta set online from the drift the learner measures.

The rollout may run ahead of the learner by eta versions (rl/coordinator.py). How far ahead is
safe depends on how fast the policy moves: a token sampled eta versions ago is only as useful as
the behaviour policy that made it is close to the learner's proximal policy. Every update with
proximal log-probs measures that gap on the tokens it trains (rl/algorithms/losses.py:
`drift_kl`, the k3 estimate of KL(behaviour || proximal), and `drift_ess`, the normalised
effective sample size of the behaviour-to-proximal importance weights), and the PPO clip
fraction.

The controller reads one signal, averaged over a window of updates, and moves eta between a
floor and a ceiling: up by one while the drift stays under `low`, halved once it passes `high`
(additive increase, multiplicative decrease, so a jump in drift is answered at once and a calm
stretch buys staleness slowly). A decision is a pure function of the logged metrics, so a
replay re-makes it from the replayed rows and checks it against the recorded one.

Lowering eta never discards work: the coordinator stops admitting new groups until the
published version catches up with the new bound; groups already admitted keep the bound they
were admitted under.
"""

from __future__ import annotations

import dataclasses
import math

# The metric each signal reads, and whether a larger value means more drift.
SIGNALS = {
    "kl": ("loss/drift_kl", True),
    "ess": ("loss/drift_ess", False),
    "clip": ("loss/clip_fraction", True),
}


@dataclasses.dataclass
class EtaController:
    """eta in [floor, ceiling], decided every `window` updates from the mean of `signal`.

    Drift is `value` for kl and clip, and 1 - value for ess (the weights' lost sample
    fraction), so `low` < `high` read the same way for every signal.
    """

    eta: int
    floor: int
    ceiling: int
    signal: str = "kl"
    low: float = 0.0
    high: float = 0.0
    window: int = 4
    seen: list = dataclasses.field(default_factory=list)  # this window's drift values

    def __post_init__(self):
        if self.signal not in SIGNALS:
            raise ValueError(f"signal {self.signal!r}: one of {sorted(SIGNALS)}")
        if not 0 <= self.floor <= self.eta <= self.ceiling:
            raise ValueError(
                f"need 0 <= floor {self.floor} <= eta {self.eta} <= ceiling {self.ceiling}"
            )
        if not self.low < self.high:
            raise ValueError(f"need low {self.low} < high {self.high}")
        if self.window < 1:
            raise ValueError(f"window {self.window}: at least 1")

    @property
    def metric(self) -> str:
        """The metrics-row key the signal reads."""
        return SIGNALS[self.signal][0]

    def drift(self, row: dict) -> float | None:
        """This update's drift from its metrics row (None: the row has no finite value)."""
        value = row.get(self.metric)
        if value is None or not math.isfinite(value):
            return None
        return float(value) if SIGNALS[self.signal][1] else 1.0 - float(value)

    def observe(self, row: dict) -> int:
        """Takes one update's metrics row; returns eta for the admissions that follow."""
        d = self.drift(row)
        if d is not None:
            self.seen.append(d)
        if len(self.seen) < self.window:
            return self.eta
        mean = sum(self.seen) / len(self.seen)
        self.seen = []
        if mean > self.high:
            self.eta = max(self.floor, self.eta // 2)
        elif mean < self.low:
            self.eta = min(self.ceiling, self.eta + 1)
        return self.eta

    def state(self) -> dict:
        """What a checkpoint keeps (JSON-able)."""
        return {"eta": self.eta, "seen": list(self.seen)}

    def restore(self, state: dict) -> None:
        """Continues from a checkpoint's state()."""
        if state:
            self.eta = int(state["eta"])
            self.seen = [float(x) for x in state["seen"]]


def from_config(cfg) -> EtaController | None:
    """The run's controller (trainer.adaptive), starting at trainer.max_staleness; None when
    eta is fixed."""
    a = cfg.trainer.adaptive
    if not a.enabled:
        return None
    return EtaController(
        eta=cfg.trainer.max_staleness,
        floor=a.floor,
        ceiling=a.ceiling,
        signal=a.signal,
        low=a.low,
        high=a.high,
        window=a.window,
    )
