"""The memory plan of a run config: the step ``longstraw train CONFIG`` would run, as ``longstraw plan --config CONFIG``
prints it and ``longstraw train --check CONFIG`` shows it.

The job is the config's (``JobSpec``: the model as the run builds it, its ``parallel`` layout, its ``engine``, dtype,
mode, group size and KL weight, AdamW), planned for the run's workload — a context of the model's limit
(``model.max_context``, or its config's) unless one is given, each member's completion of ``sampling.max_new_tokens``,
the groups a dp rank trains per step — on ``dp x cp`` GPUs of ``gpu_mem_bytes`` each.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from longstraw_agents.app.config import ConfigError, TrainConfig, check_model, check_tokenizer
from longstraw_agents.models import context_limit
from longstraw_agents.plan import PlanShape

if TYPE_CHECKING:
    from longstraw_agents.plan import PlanRequest

GPU_MEM_BYTES: int = PlanShape.gpu_mem_bytes  # what a plan assumes of a GPU unless told (`plan --gpu-mem`)


def run_plan_request(
    config: TrainConfig,
    *,
    context: int | None = None,
    history: int = 0,
    turns: int = 1,
    gpu_mem_bytes: int = GPU_MEM_BYTES,
    cp_rank: int | None = None,
) -> PlanRequest:
    """The plan request of ``config``'s step (``PlanRequest.of_job``); ``context``: the shared prompt's positions
    (default: the model's limit), ``history`` / ``turns``: an agent's own history after it (``plan --history``). A
    model or tokenizer that cannot be read is a ``ConfigError``, a workload the job cannot plan a ``ValueError``."""
    from longstraw_agents.plan import PlanRequest

    tokenizer = check_tokenizer(config.tokenizer)
    model = check_model(config.model, tokenizer.vocab_size)
    if context is None:
        context = context_limit(model, config.model.max_context)
        if context is None:
            raise ConfigError("model: its config gives no context limit (max_position_embeddings): give --context")
    return PlanRequest.of_job(
        config,
        model,
        context=context,
        completion=config.sampling.max_new_tokens,
        gpu_mem_bytes=gpu_mem_bytes,
        history=history,
        turns=turns,
        groups_per_rank=math.ceil(config.groups_per_step / config.parallel.dp),
        cp_rank=cp_rank,
    )
