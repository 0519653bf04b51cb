"""What a plan plans: ``PlanRequest``, a ``PlanShape`` (the step's sizes and how the GPUs split, checked without
torch) with the dtype, the engine and the LoRA adapters the step runs, and what follows from them (which extends run
sharded, whether the walk is a wavefront, how many layers a capture holds whole...). ``PLAN_ENGINE``: the engine
planned without a run config.
"""

from __future__ import annotations

import math

import torch
from pydantic import ConfigDict, InstanceOf, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from transformers import PretrainedConfig

from longstraw_agents.engine import EngineConfig
from longstraw_agents.engine.schedule import (
    WalkHolds,
    capture_layers_whole,
    rows_read,
    shards_extend,
    walk_holds,
    walk_inputs_held,
)
from longstraw_agents.job import JobSpec, engine_problem, extends_may_shard
from longstraw_agents.models.lora import LoraSpec
from longstraw_agents.parallel.fsdp import prefetch_window
from longstraw_agents.plan.shape import PlanShape

# The engine `longstraw plan` assumes without a run config (the published configuration; printed with every plan,
# as each setting that differs from EngineConfig's defaults): 4K-token chunks, activation checkpointing (at these
# sizes a branch's full graph would dominate: see the README) and a GPU's budget for DSA index scores (512 MiB fp32,
# not a CPU test's 4 MiB). A run config's plan (`plan --config`, `PlanRequest.of_job`) takes the run's `engine:`.
PLAN_ENGINE = EngineConfig(chunk_size=4096, activation_checkpointing=True, max_score_elements=1 << 27)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@pydantic_dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True, strict=True, extra="forbid"))
class PlanRequest(PlanShape):
    """What to plan: a ``PlanShape`` (the step's sizes and how the GPUs split, checked without torch) and the dtype
    and engine the step runs. ``of_job`` makes the request of a job (``JobSpec``: model, parallel, engine, trainer)
    for a workload's shape and a GPU: what ``longstraw plan --config`` and ``train --check`` plan.

    Validated on construction (and by ``dataclasses.replace``) as ``PlanShape`` is, and mixed precision needs a dtype
    narrower than fp32; a bad value raises pydantic's ``ValidationError``, an unknown keyword a ``TypeError`` of one
    line (an engine setting is named as ``engine=EngineConfig(...)``'s)."""

    # a name of NAMED_MODELS, a transformers config.json (or its folder), or the config itself (a run's model; a
    # dataclass in transformers 5, taken as an instance rather than validated field by field). (Wider than
    # PlanShape's str, which has no transformers: sound, the request being frozen.)
    model: str | InstanceOf[PretrainedConfig] = "qwen3.6-27b"  # type: ignore[assignment]
    dtype: torch.dtype = torch.bfloat16
    # master weights in fp32, compute in ``dtype`` (GRPOConfig.mixed_precision); None: on when ``dtype`` is narrower
    mixed_precision: bool | None = None
    engine: EngineConfig = PLAN_ENGINE  # the engine the step runs (its chunk, checkpoints, walk, graph budget)
    lora: LoraSpec | None = None  # LoRA adapters train instead of the weights (model.lora)

    @classmethod
    def of_job(
        cls,
        job: JobSpec,
        model: PretrainedConfig,
        *,
        context: int,
        completion: int,
        gpu_mem_bytes: int,
        history: int = 0,
        turns: int = 1,
        groups_per_rank: int = 1,
        cp_rank: int | None = None,
    ) -> PlanRequest:
        """The plan of ``job`` — the model of ``model`` (its transformers config, as the run builds it), the job's
        layout (``parallel``: FSDP2 only where it shards), engine, dtype (``model.dtype``, or the compute dtype of
        ``trainer.mixed_precision`` over its masters), LoRA adapters, mode, group size, KL weight and AdamW — for a
        workload's shape
        (a shared ``context``, each member's ``completion``, or an agent's ``history`` over ``turns``; the groups a dp
        rank trains per optimizer step) on GPUs of ``gpu_mem_bytes``, ``dp x cp`` of them."""
        trainer, parallel = job.trainer, job.parallel
        if trainer.mode == "naive":
            raise ValueError(
                "trainer.mode naive builds one graph per member over the whole sequence: the planner plans detached "
                "and exact modes"
            )
        precision = trainer.mixed_precision
        if precision is not None and job.model.dtype != "float32":
            raise ValueError(
                f"the planner plans mixed precision over float32 masters, not model.dtype {job.model.dtype}"
            )
        return cls(
            model=model,
            context=context,
            group=trainer.group_size,
            completion=completion,
            history=history,
            turns=turns,
            gpus=parallel.dp * parallel.cp,
            gpu_mem_bytes=gpu_mem_bytes,
            dp=parallel.dp,
            cp=parallel.cp,
            fsdp=parallel.fsdp,
            mode=trainer.mode,
            optimizer="adamw",
            offload=parallel.offload,
            hsdp=parallel.hsdp,
            expert_parallel=parallel.expert_parallel,
            expert_dispatch=parallel.expert_dispatch,
            lora=job.model.lora,
            beta=trainer.loss.beta,
            cp_rank=cp_rank,
            groups_per_rank=groups_per_rank,
            dtype=getattr(torch, precision.compute_dtype if precision is not None else job.model.dtype),
            mixed_precision=precision is not None,
            engine=job.engine,
        )

    @classmethod
    def _elsewhere(cls) -> dict[str, str]:
        """Settings of the engine a misplaced keyword may mean (``engine=EngineConfig(chunk_size=...)``)."""
        return {name: f"engine=EngineConfig({name}=...)" for name in EngineConfig.model_fields}

    @property
    def model_name(self) -> str:
        """The model as a plan names it: its name or path, or a config's own name (its type when it has none)."""
        if isinstance(self.model, str):
            return self.model
        return getattr(self.model, "name_or_path", "") or self.model.model_type

    @property
    def sharded_history(self) -> int:
        """The positions of a member's history extended sharded (``Engine.sharded``: at least as long as the path
        before it — the tree's root, the context less the token that opens the members — or as
        ``sharded_extend_tokens``), 0 for none. Each turn is a tool output and a ``completion``-token answer. Exact
        mode fuses runs of turns whose tool outputs fit a chunk (``fuse_chains``): all but the last answer, one
        extend; longer tool outputs stay apart, the first extended after the root. Detached mode extends each tool
        output apart. A kept-graph budget, or ``sharded_extends=False``, computes every extend replicated."""
        if not self.history or self.context_parallel == 1 or not self.sharded_extends:
            return 0
        output = math.ceil(self.history / self.turns) - self.completion
        fused = self.mode == "exact" and output <= self.engine.chunk_size
        n = self.history - self.completion if fused else output
        return n if shards_extend(n, self.context - 1, self.engine.sharded_extend_tokens) else 0

    @property
    def sharded_extends(self) -> bool:
        """Whether a long extend (a capture) runs sharded over the cp ranks: not with a kept-graph budget (its graphs
        need every chunk on every rank), nor with ``EngineConfig.sharded_extends=False``, nor under expert
        parallelism unless its tokens are dispatched (``expert_dispatch``)."""
        return self.sampler_shards and self.engine.graph_budget_bytes == 0

    @property
    def sampler_shards(self) -> bool:
        """Whether a sampler's long extends run sharded: as ``sharded_extends``, but a kept-graph budget is the
        step's (a sampler keeps no graphs)."""
        experts_allow = extends_may_shard(self.expert_parallel, self.expert_dispatch)
        return self.context_parallel > 1 and self.engine.sharded_extends and experts_allow

    @property
    def dispatched(self) -> bool:
        """Under expert parallelism, whether the step's long extends run sharded, each MoE call a round of
        all-to-alls (``parallel.experts.ExpertExchange``)."""
        return self.expert_parallel and self.sharded_extends

    @property
    def keeps_layer_inputs(self) -> bool:
        """Whether an exact-mode capture keeps layer inputs for the wavefront walk (``EngineConfig.wavefront_walk``;
        not under expert parallelism, whose rounds carry no gradient: its walk is replicated)."""
        return self.engine.wavefront_walk and not self.expert_parallel

    @property
    def wavefront(self) -> bool:
        """Whether exact mode's walk runs as a wavefront over the cp ranks (their captures kept layer inputs)."""
        return self.mode == "exact" and self.keeps_layer_inputs and self.sharded_extends

    def shards_by_threshold(self, n: int) -> bool:
        least = self.engine.sharded_extend_tokens
        return least is not None and n >= least

    @property
    def walked_back_sharded(self) -> bool:
        """Exact mode: whether a member's history is walked back to the context sharded (its capture kept layer
        inputs), so that a rank holds the gradient of the other ranks' context rows its queries read until its walk
        is done."""
        return self.wavefront and self.sharded_history > 0

    @property
    def earlier_ranks(self) -> int:
        """How many cp ranks before the planned one send it their rows in a capture cut in rank order (the last
        rank by default)."""
        return self.context_parallel - 1 if self.cp_rank is None else self.cp_rank

    @property
    def balanced_context(self) -> bool:
        """Whether the step's capture of the context is cut balanced (``EngineConfig.balanced_captures``; exact
        mode's wavefront walk then walks the balanced cut too)."""
        return self.engine.balanced_captures

    @property
    def balanced_history(self) -> bool:
        """Whether a member's history captured sharded is cut balanced (as the context's)."""
        return self.engine.balanced_captures

    @property
    def walk_gathers_ahead(self) -> int:
        """The gathers exact mode's wavefront walk has started ahead of the planned rank's cell: ``prefetch_window``;
        paced (``paced_walk``), each wave's as it falls due, counted over the walk's own schedule
        (``engine.schedule.walk_holds``: a rank r < cp - 1 holds ``r + 1`` of the later wave and ``cp - 1 - r`` of
        the earlier beside its cell's; the last rank none)."""
        if not self.paced_walk:
            return prefetch_window(self.context_parallel)
        return self.walk_holds().whole - 1

    def walk_holds(self) -> WalkHolds:
        """What the planned rank (rank 0 by default) holds at once in a paced walk (``engine.schedule.walk_holds``;
        the same for any segment length)."""
        return walk_holds(self.context_parallel, self.balanced_rank(), 1)

    def walk_inputs_held(self, layers: int, every: int) -> float:
        """The most recomputed layer inputs the planned rank holds at once in exact mode's walk, in its walked rows
        (``engine.schedule.walk_inputs_held``: a segment's ``every - 1``; paced, a later run's of the segment before
        as well); by default the most of any rank (the planned rank holds the most of each term)."""
        cp, paced, balanced = self.context_parallel, self.paced_walk, self.balanced_context
        ranks = range(cp) if self.cp_rank is None else [self.cp_rank]
        return max(walk_inputs_held(cp, rank, layers, every, paced, balanced) for rank in ranks)

    @property
    def paced_walk(self) -> bool:
        """Whether exact mode's wavefront walk runs a balanced cut over sharded weights (``walk_events``; over whole
        weights it is not paced: ``WavefrontWalk.paced``): every rank recomputes each segment when the first run
        enters it, so a later run holds its inputs up to ``cp - 1`` layers longer, and a rank keeps each cell's layer
        gradient until its wave's reduction (up to ``cp - 1`` layers' more)."""
        return self.wavefront and self.balanced_context and self.context_parallel > 1 and self.sharded

    def step_capture_cuts(self) -> list[bool]:
        """How the step's sharded captures are cut (balanced or not): the context's, and a member's history's."""
        return [self.balanced_context, *([self.balanced_history] if self.sharded_history else [])]

    def balanced_rank(self) -> int:
        """The cp rank planned for a balanced capture's terms (rank 0 by default: the most rows received)."""
        return 0 if self.cp_rank is None else self.cp_rank

    def captured_rank(self, balanced: bool) -> int:
        """The cp rank planned for a sharded capture's terms: balanced ``balanced_rank``, in rank order the last
        (the most rows received) unless ``cp_rank`` says."""
        return self.balanced_rank() if balanced else self.earlier_ranks

    def captured_shards(self, balanced: bool) -> float:
        """Of a sharded capture, how many shards (``n / cp`` positions) of other ranks' rows the planned rank
        attends to at once (a cell's, dropped after it), counted over the cut (``engine.schedule.rows_read``): in
        rank order the earlier ranks'; balanced, those before its later run but its own first, ``2cp - 2 - r`` runs
        of half a shard."""
        return rows_read(self.context_parallel, self.captured_rank(balanced), balanced)

    def capture_gathers_ahead(self, balanced: bool) -> int:
        """How many gathers a sharded capture has started ahead of the cell the planned rank computes: each is
        started at the wavefront step it falls due (``engine.capture_gathers``)."""
        return self.capture_layers_whole(balanced) - 1

    def capture_layers_whole(self, balanced: bool) -> int:
        """The decoder layers a sharded capture holds whole at once on the planned rank, counted over the capture's
        own schedule (``engine.schedule.capture_layers_whole``): ``cp`` on every rank balanced (a layer is gathered
        once per wave of runs), ``1 + r`` in rank order."""
        return capture_layers_whole(self.context_parallel, self.captured_rank(balanced), balanced)

    @property
    def mixed(self) -> bool:
        narrow = element_size(self.dtype) < 4
        return narrow if self.mixed_precision is None else self.mixed_precision

    @property
    def master_itemsize(self) -> int:
        """Bytes per parameter of the weights AdamW steps (and of its moments and the sharded gradients)."""
        return 4 if self.mixed else element_size(self.dtype)

    @model_validator(mode="after")
    def _precision_and_engine_fit(self) -> PlanRequest:
        if self.mixed_precision and element_size(self.dtype) >= 4:
            raise ValueError(f"mixed precision computes in a dtype narrower than its fp32 masters, not {self.dtype}")
        problem = engine_problem(self.expert_parallel, self.expert_dispatch, self.engine)
        if problem is not None:
            raise ValueError(problem)
        return self
