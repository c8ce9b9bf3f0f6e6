"""Online RL: one LightningModule (module.py), a learner (learner.py), the collect stage
(rollouts.py, collect.py, producer.py, sampler.py) and the parts (part.py, parts/)."""

from posttrain.algorithms.online.module import OnlineRLModule

__all__ = ["OnlineRLModule"]
