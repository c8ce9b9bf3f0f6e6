"""Coefficient schedules over rollout batches: a weight that moves from `start` to `end`.

KDRL anneals the distillation weight beta from strong imitation of the teacher to a
reward-driven policy (Xu et al. 2025). With p = min(step / steps, 1):

  constant   start (end and steps are not read)
  linear     start + (end - start) * p
  cosine     end + (start - end) * (1 + cos(pi * p)) / 2
  step       linear, held constant between multiples of `step_every`:
             linear at floor(step / step_every) * step_every (a staircase)

Every schedule is at `start` for step 0 and at `end` from `steps` on (constant: always
`start`; step: from the first multiple of `step_every` at or after `steps`).
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine", "step")


def scheduled_coef(name: str, step: int, *, start: float, end: float = 0.0, steps: int = 1,
                   step_every: int = 1) -> float:
    """The coefficient of schedule ``name`` after ``step`` rollout batches (see module doc)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if name == "constant":
        return float(start)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer (rollout batches from start to end), got {steps!r}")
    if name == "step":
        if not isinstance(step_every, int) or step_every < 1:
            raise ValueError(f"step_every must be a positive integer, got {step_every!r}")
        step = (step // step_every) * step_every
    progress = min(step / steps, 1.0)
    if name == "cosine":
        return float(end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    return float(start + (end - start) * progress)
