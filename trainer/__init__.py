"""GRPO training over prefix trees: the loss, the three execution modes and the trainer.

    from longstraw_agents.trainer import grpo_backward, GRPOConfig, GRPOTrainer
    result = grpo_backward(model, prompt_ids, completions, rewards, mode="exact")  # accumulates into param.grad
    result.loss, result.loss_tokens, result.forward_tokens

Modules: ``loss`` (``LossConfig``, advantages, aggregations, ``GRPOLoss``), ``group`` (``Group`` and its members),
``node_loss`` (the loss of one prefix-tree node), ``modes`` (naive | detached | exact), ``metrics`` (typed result
records), ``grpo`` (``backward_group``, ``grpo_backward``, ``grpo_backward_trajectories``), ``config``
(``GRPOConfig``), ``trainer`` (``GRPOTrainer``), ``sft`` (supervised warm start).
"""

from longstraw_agents.trainer.config import GRPOConfig, OptimizerConfig
from longstraw_agents.trainer.group import Group, make_group
from longstraw_agents.trainer.grpo import backward_group, grpo_backward, grpo_backward_trajectories
from longstraw_agents.trainer.loss import GRPOLoss, IcePopLoss, LossConfig, RatioLoss, TISLoss, group_advantages
from longstraw_agents.trainer.metrics import BackwardResult, StepMetrics
from longstraw_agents.trainer.modes import MODES, ModeName
from longstraw_agents.trainer.trainer import GRPOTrainer

__all__ = [
    "MODES",
    "BackwardResult",
    "GRPOConfig",
    "GRPOLoss",
    "GRPOTrainer",
    "Group",
    "IcePopLoss",
    "LossConfig",
    "ModeName",
    "OptimizerConfig",
    "RatioLoss",
    "StepMetrics",
    "TISLoss",
    "backward_group",
    "grpo_backward",
    "grpo_backward_trajectories",
    "group_advantages",
    "make_group",
]
