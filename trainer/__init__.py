"""GRPO training over prefix trees: the loss, the three execution modes and the trainer.

>>> from longstraw_agents.trainer import grpo_backward, GRPOConfig, GRPOTrainer
>>> stats = grpo_backward(model, prompt_ids, completions, rewards, mode="exact")  # accumulates into param.grad
"""

from longstraw_agents.trainer.config import GRPOConfig, ModeName, OptimizerConfig
from longstraw_agents.trainer.grpo import (
    MODES,
    BackwardResult,
    Group,
    backward_group,
    grpo_backward,
    grpo_backward_trajectories,
    make_group,
)
from longstraw_agents.trainer.loss import LossConfig, group_advantages, per_token_loss
from longstraw_agents.trainer.trainer import GRPOTrainer

__all__ = [
    "MODES",
    "BackwardResult",
    "GRPOConfig",
    "GRPOTrainer",
    "Group",
    "LossConfig",
    "ModeName",
    "OptimizerConfig",
    "backward_group",
    "grpo_backward",
    "grpo_backward_trajectories",
    "group_advantages",
    "make_group",
    "per_token_loss",
]
