"""When a periodic part of the training loop is due: the one rule that saving, evaluating, logging
and the replica check each apply with their own period."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Every:
    """Due at each `n`-th step (never, when `n` is 0) and at the last step, whatever `n`."""

    n: int

    def due(self, step: int, last: bool) -> bool:
        return last or (self.n > 0 and step % self.n == 0)
