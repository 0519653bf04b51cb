"""The memory planner: the peak per GPU of a GRPO step before renting the GPUs (``longstraw plan``).

It runs the project's real engine and trainer code — capture, branch replay, exact mode's reverse walk — on the meta
device under ``MemoryTracker``: tensors have shapes and byte sizes but no storage and no arithmetic (attention takes
the ``meta`` backend, a fused kernel's allocations without its work; a MoE's experts the grouped kernel's, which
do not depend on the routing, except a dispatched round's rows, taken as balanced). Walking
2M tokens x 64 layers in Python would take long, so it simulates a few chunks on models cut to one and two periods
of their layer pattern, and extrapolates:

- what grows with the context is exact: the engine's state of the rank's positions (``state_size``: attention K/V,
  MLA rows, DSA index keys), exact mode's state gradient (fp32 for bf16 states), recurrent checkpoints every k
  chunks; with context parallelism each rank holds ``context / cp`` positions (the sharding ``parallel/`` will do,
  taken analytically here);
- what does not — one chunk's graph, one branch's graph, the LM head's log-prob tiles and the head's weight gradient —
  is measured on the cut models (peak minus the exact terms) and extrapolated linearly in the number of layer
  periods;
- weights, gradients and AdamW state are counted from the model's parameters as the trainer holds them (a LoRA
  policy, ``PlanRequest.lora``: every weight, frozen or not, but gradients and AdamW state for the adapters only, the
  probes' models carrying the adapters, so that the graphs hold no weight gradient of a frozen weight)
  (``parameter_phases``): shards over all ``dp x cp`` GPUs in the master dtype (fp32 with mixed precision), and what
  the schedule of ``parallel.fsdp`` holds whole at once — at dp = 1 the root unit, the decoder layers a sharded
  capture holds (the cell's and the gathers started as they fall due: cp balanced, 1 + r on rank r in rank order)
  and one in a branch replay, with the gradients on their way to the shards; at
  dp > 1 the whole model for the step; the frozen reference model (sharded as the policy: its shards, and its root
  unit or the whole model for the step) and its captured state when ``beta > 0``; under expert parallelism
  (``expert_parallel``) a gather without the routed experts, each rank's own experts (cast, and their gradient on
  its way into the shard), every extend replicated (the probe runs a rank's experts: ``ExpertShard.planned``) or
  with ``expert_dispatch`` long ones sharded, each MoE call a round (``PlannedExchange``: routing even);
- a step has two phases, and the plan is the larger: the capture (its gathered layers, the other cp ranks' rows
  its cells read, for the cp rank ``cp_rank``: by default the rank that holds the most of each term — rank 0 of a
  balanced capture, the last in rank order) and the backward passes (a layer and its gradient,
  the state gradient, the walk's recomputed segment: a balanced walk over sharded weights holds up to cp - 1 layers'
  inputs and gradients more, ``PlanRequest.paced_walk``); both hold the state and a graph;
- an allocator margin, stated as such: 5 % of the total plus 1 GiB (CUDA context, kernels' workspaces,
  fragmentation).

    plan = plan_memory(PlanRequest(model="qwen3.6-27b", context=2_100_000, group=8, gpus=8))
    print(plan.table())
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ConfigDict, InstanceOf, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from longstraw_agents.engine import Engine, EngineConfig, LayerInputs, checkpoint_spacing, layer_inputs_spacing
from longstraw_agents.engine.wavefront import GRADIENT_BUCKET_BYTES
from longstraw_agents.job import JobSpec, engine_problem
from longstraw_agents.logprobs import DEFAULT_TILE_ELEMENTS
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import adapter_class, state_size
from longstraw_agents.models.lora import LoraSpec, apply_lora, lora_layers
from longstraw_agents.models.presets import TINY_PRESETS, glm_5_2_like, qwen3_6_27b_like
from longstraw_agents.parallel.experts import PlannedExchange
from longstraw_agents.parallel.fsdp import prefetch_window
from longstraw_agents.plan_shape import PlanShape, model_problem
from longstraw_agents.segmenter import Member
from longstraw_agents.trainer.group import make_group
from longstraw_agents.trainer.loss import LossConfig
from longstraw_agents.trainer.modes import MODES

GIB = 2**30
MARGIN_FRACTION = 0.05
MARGIN_FIXED = GIB
CATEGORY_WIDTH = 38  # the table's category column
NAMED_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3.6-27b": qwen3_6_27b_like,
    "glm-5.2": glm_5_2_like,
    **{f"tiny-{name}": fn for name, fn in TINY_PRESETS.items()},
}
PER_LAYER_LISTS = ("layer_types", "indexer_types", "mlp_layer_types")
CONTEXT_SEARCH_LIMIT = 1 << 26  # longest_context tries lengths below this (67M positions)
# The engine `longstraw plan` assumes without a run config (the published configuration; printed with every plan,
# as each setting that differs from EngineConfig's defaults): 4K-token chunks, activation checkpointing (at these
# sizes a branch's full graph would dominate: see the README) and a GPU's budget for DSA index scores (512 MiB fp32,
# not a CPU test's 4 MiB). A run config's plan (`plan --config`, `PlanRequest.of_job`) takes the run's `engine:`.
PLAN_ENGINE = EngineConfig(chunk_size=4096, activation_checkpointing=True, max_score_elements=1 << 27)


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
        return n if n >= self.context - 1 or self.shards_by_threshold(n) else 0

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
        experts_allow = not self.expert_parallel or self.expert_dispatch
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
        paced (``paced_walk``), each wave's as it falls due: at a step where the rank walks both its runs, all of that
        step's gathers are started before its first cell, so a rank r < cp - 1 holds ``r + 1`` of the later wave
        and ``cp - 1 - r`` of the earlier beside its cell's (``cp``); the last rank none (it leads the earlier wave
        and has no run in the later)."""
        cp = self.context_parallel
        if not self.paced_walk:
            return prefetch_window(cp)
        return 0 if self.cp_rank == cp - 1 else cp

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

    def captured_shards(self, balanced: bool) -> float:
        """Of a sharded capture, how many shards (``n / cp`` positions) of other ranks' rows the planned rank
        attends to at once (a cell's, dropped after it): cut in rank order, the earlier ranks'; balanced (rank r
        computes the r-th and the (2cp - 1 - r)-th of 2cp runs, the middle two together), those before its later
        run but its own first: ``2cp - 2 - r`` runs of half a shard."""
        if not balanced:
            return self.earlier_ranks
        return (2 * self.context_parallel - 2 - self.balanced_rank()) / 2

    def capture_gathers_ahead(self, balanced: bool) -> int:
        """How many gathers a sharded capture has started ahead of the cell the planned rank computes: each is
        started at the wavefront step it falls due (``engine.capture_gathers``). In rank order that is as many as
        the steps the rank trails rank 0 (``r``); balanced, a layer is gathered once per wave of runs, due when
        the wave's first run reaches it: ``cp - 1`` on every rank (rank r: ``r`` of the first wave, ``cp - 1 - r``
        of the second, one of which its other cell of the step takes)."""
        return self.context_parallel - 1 if balanced else self.earlier_ranks

    def capture_layers_whole(self, balanced: bool) -> int:
        """The decoder layers a sharded capture holds whole at once on the planned rank: the cell's layer and the
        gathers started ahead (``capture_gathers_ahead``) — ``cp`` on every rank balanced, ``1 + r`` in rank
        order."""
        return 1 + self.capture_gathers_ahead(balanced)

    @property
    def mixed(self) -> bool:
        narrow = _itemsize(self.dtype) < 4
        return narrow if self.mixed_precision is None else self.mixed_precision

    @property
    def master_itemsize(self) -> int:
        """Bytes per parameter of the weights AdamW steps (and of its moments and the sharded gradients)."""
        return 4 if self.mixed else _itemsize(self.dtype)

    @model_validator(mode="after")
    def _precision_and_engine_fit(self) -> PlanRequest:
        if self.mixed_precision and _itemsize(self.dtype) >= 4:
            raise ValueError(f"mixed precision computes in a dtype narrower than its fp32 masters, not {self.dtype}")
        problem = engine_problem(self.expert_parallel, self.expert_dispatch, self.engine)
        if problem is not None:
            raise ValueError(problem)
        return self


@dataclass
class Plan:
    """Bytes per GPU by category, the allocator margin, and how the figures were obtained."""

    request: PlanRequest
    categories: dict[str, int]
    notes: list[str] = field(default_factory=list)
    # what a rank holds while the run samples in process (``rollout_terms``): a phase of its own, between steps
    rollout: dict[str, int] = field(default_factory=dict)
    # what each GPU's process keeps on the host (``host_terms``: offloaded, other dp ranks' rows): not in the GPU's
    host: dict[str, int] = field(default_factory=dict)

    @property
    def subtotal(self) -> int:
        return sum(self.categories.values())

    @property
    def rollout_subtotal(self) -> int:
        return sum(self.rollout.values())

    @property
    def rollout_total(self) -> int:
        return self.rollout_subtotal + _margin(self.rollout_subtotal)

    @property
    def rollout_fits(self) -> bool:
        return self.rollout_total <= self.request.gpu_mem_bytes

    @property
    def margin(self) -> int:
        return _margin(self.subtotal)

    @property
    def total(self) -> int:
        return self.subtotal + self.margin

    @property
    def fits(self) -> bool:
        return self.total <= self.request.gpu_mem_bytes

    def table(self) -> str:
        r = self.request
        lines = [
            f"{r.model_name}: {r.context:,} positions, G={r.group} x "
            + (f"{r.history:,}-token histories over {r.turns} turns, " if r.history else f"{r.completion} tokens, ")
            + f"{r.mode}, "
            f"{str(r.dtype).removeprefix('torch.')}, {r.gpus} GPUs x {r.gpu_mem_bytes / 1e9:.0f} GB "
            f"(dp={r.data_parallel}, cp={r.context_parallel}{'' if r.sharded or r.gpus == 1 else ', no fsdp'}), "
            f"optimizer {r.optimizer}"
            + (", offloaded to the host" if r.offload else "")
            + (f", beta={r.beta}" if r.beta else ""),
            engine_text(r.engine),
            f"{'per GPU':<{CATEGORY_WIDTH + 2}} {'GiB':>9}",
        ]
        lines += [f"  {name:<{CATEGORY_WIDTH}} {value / GIB:>9.2f}" for name, value in self.categories.items()]
        lines.append(f"  {'allocator margin (5% + 1 GiB)':<{CATEGORY_WIDTH}} {self.margin / GIB:>9.2f}")
        lines.append(f"  {'total':<{CATEGORY_WIDTH}} {_against(self.total, r.gpu_mem_bytes)}")
        if self.rollout:
            # serving the policy helps only a step that fits: otherwise the step's own verdict is what to act on
            serve = ": serve the policy instead (policy.served)" if self.fits else ""
            lines.append("rollouts in process (longstraw train's own sampler, on every cp rank; between steps)")
            lines += [f"  {name:<{CATEGORY_WIDTH}} {value / GIB:>9.2f}" for name, value in self.rollout.items()]
            total = _against(self.rollout_total, r.gpu_mem_bytes, not_fitting=serve)
            lines.append(f"  {'total (with the margin)':<{CATEGORY_WIDTH}} {total}")
        if self.host:
            lines.append("on the host, per GPU's process (not in the figures above)")
            lines += [f"  {name:<{CATEGORY_WIDTH}} {value / GIB:>9.2f}" for name, value in self.host.items()]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def engine_text(engine: EngineConfig) -> str:
    """The engine a plan plans, as its table prints it: each setting that differs from ``EngineConfig``'s defaults
    (a run config's ``engine:`` section gives them as written here)."""
    changed = engine.model_dump(exclude_defaults=True)
    said = ", ".join(f"{name}={value!r}" for name, value in changed.items())
    return f"engine: {said} (EngineConfig's defaults otherwise)" if said else "engine: EngineConfig's defaults"


def _against(total: int, capacity: int, not_fitting: str = "") -> str:
    """``total`` bytes against a GPU's ``capacity`` as the table prints them: both in GiB to the same two decimals
    (rounding both alike never shows a total that fits above its capacity, nor one that does not below it), the
    verdict (``not_fitting`` added to "does NOT fit"), and by how much where the rounded figures are the same."""
    shown, of = f"{total / GIB:.2f}", f"{capacity / GIB:.2f}"
    fits = total <= capacity
    verdict = "fits" if fits else f"does NOT fit{not_fitting}"
    if shown == of:
        verdict += f" (by {abs(capacity - total) / 2**20:,.1f} MiB)"
    return f"{shown:>9}  of {of} GiB: {verdict}"


def _margin(subtotal: int) -> int:
    """The allocator margin added to ``subtotal`` bytes: ``MARGIN_FRACTION`` of them and ``MARGIN_FIXED``."""
    return int(MARGIN_FRACTION * subtotal) + MARGIN_FIXED


def load_config(model: str | PretrainedConfig) -> PretrainedConfig:
    """The config of a model named in ``NAMED_MODELS``, or of a transformers ``config.json`` (or a folder with one);
    a config itself as it is (a run's: ``PlanRequest.of_job``)."""
    if isinstance(model, PretrainedConfig):
        return model
    if model in NAMED_MODELS:
        return NAMED_MODELS[model]()
    problem = model_problem(model, NAMED_MODELS)
    if problem is not None:
        raise ValueError(problem)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


# --- layer periods: cut a config to a few layers and extrapolate ------------------------------------------------


def layer_kinds(config: PretrainedConfig) -> list[tuple[Any, ...]]:
    """Per layer, what distinguishes it (attention kind, indexer kind, MLP kind)."""
    lists = [getattr(config, name, None) or [None] * config.num_hidden_layers for name in PER_LAYER_LISTS]
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    return [(*(lst[i] for lst in lists), i < dense) for i in range(config.num_hidden_layers)]


def layer_period(config: PretrainedConfig) -> tuple[int, int]:
    """``(head, period)``: the first ``head`` layers are special, the rest repeat every ``period`` layers."""
    kinds = layer_kinds(config)
    n = len(kinds)
    for head in range(n):
        tail = kinds[head:]
        for period in range(1, max(len(tail) // 2, 1) + 1):
            if all(tail[i] == tail[i % period] for i in range(len(tail))):
                return head, period
    return 0, n


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """The config cut to its first ``layers`` layers."""
    data = config.to_dict()
    data["num_hidden_layers"] = layers
    for name in PER_LAYER_LISTS:
        if data.get(name):
            data[name] = data[name][:layers]
    return type(config)(**data)


# --- one simulated step on the meta device ----------------------------------------------------------------------


def meta_model(config: PretrainedConfig, dtype: torch.dtype, lora: LoraSpec | None = None) -> Any:
    """A transformers CausalLM of ``config`` on the meta device (no storage), with ``lora``'s adapters."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    model = model.to(dtype)
    return apply_lora(model, lora) if lora is not None else model


def step_peak(model: Any, request: PlanRequest, prompt_len: int, group: int) -> int:
    """Peak bytes of one GRPO step of ``request.mode`` (the gradients of the parameters that train allocated
    beforehand, not counted)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.empty_like(p)
    engine = _engine(model, request)
    ref_engine = _engine(model, request) if request.beta > 0 else None  # same shapes as the policy
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, prompt_len)
    members = [Member.from_prompt_completion(prompt, rng.integers(0, vocab, request.completion)) for _ in range(group)]
    config = LossConfig(beta=request.beta)
    grouped = make_group(members, [float(k % 2) for k in range(group)], config)  # rewards that differ
    runner = MODES[request.mode](engine, config, ref_engine)
    with MemoryTracker() as tracker:
        runner.run(grouped)
    return tracker.peak_bytes


def _engine(model: Any, request: PlanRequest, exchange: PlannedExchange | None = None) -> Engine:
    """An engine over the meta ``model`` as a rank runs it: under expert parallelism each MoE layer computes one
    rank's experts (``ExpertShard.planned``: what their computation holds, and a backward that recomputes it; their
    cast and gradient are counted from the parameters, ``_whole_at_once``), or with ``exchange`` a sharded
    extend's rounds."""
    engine = Engine(model, request.engine)
    if request.expert_parallel:  # (replicated calls while the exchange is not dispatching)
        (exchange or PlannedExchange(request.context_parallel)).bind(engine.adapter.layers)
    return engine


def capture_working_set(model: Any, request: PlanRequest, prompt_len: int) -> int:
    """What a capture holds beyond the state it keeps: one chunk's no-grad working set (at its peak); under expert
    parallelism with sharded extends, each MoE call a round (``PlannedExchange``)."""
    # (the sampler's captures dispatch where the step's do not: under a kept-graph budget; the larger is planned)
    dispatching = request.expert_parallel and request.sampler_shards
    exchange = PlannedExchange(request.context_parallel) if dispatching else None
    engine = _engine(model, request, exchange)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt_len)
    with torch.no_grad(), exchange.dispatching() if exchange is not None else contextlib.nullcontext():
        with MemoryTracker() as tracker:
            state = engine.capture(prompt.tolist())
            kept = tracker.current_bytes
    del state
    return tracker.peak_bytes - kept


# --- the plan -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Exact:
    """The terms that grow with the context, from the engine's own accounting."""

    state: int
    dstate: int
    checkpoints: int
    reference_state: int
    layer_inputs: int = 0
    layer_inputs_kept: int = 0  # (of layer_inputs: what the capture keeps, the rest the walk's segment)
    capture_rows: int = 0
    context_grads: int = 0  # the other ranks' context rows' gradient, held until a sharded walk back is done


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def exact_terms(config: PretrainedConfig, request: PlanRequest, positions: int) -> _Exact:
    """State, its gradient (exact mode: at least fp32), recurrent checkpoints and the reference's state."""
    size = state_size(config, request.dtype)
    state = size.total(positions)
    exact = request.mode == "exact"
    widen = max(_itemsize(request.dtype), 4) / _itemsize(request.dtype)
    # (an agent's last answer is replayed with gradient sinks over the whole path before its history is walked)
    dstate = int(size.bytes_per_token * positions * widen) + size.fixed_bytes if exact else 0
    spacing = checkpoint_spacing(config, request.dtype, request.engine)
    checkpoints = size.fixed_bytes * (math.ceil(positions / request.engine.chunk_size) // spacing) if exact else 0
    kept, segment = layer_inputs_bytes(config, request, positions)
    rows = capture_rows_bytes(config, request)
    reference = state if request.beta > 0 else 0
    return _Exact(state, dstate, checkpoints, reference, kept + segment, kept, rows, context_grads(config, request))


def context_grads(config: PretrainedConfig, request: PlanRequest) -> int:
    """Exact mode's sharded walk of a member's history back to the context (``WavefrontWalk`` after ``since``): the
    planned cp rank holds the gradient of the other ranks' context rows its queries read until its walk is done
    (fp32 for a bf16 state), summed over its cells: ``(cp - 1) / cp`` of the context's on every rank."""
    if not request.walked_back_sharded:
        return 0
    cp = request.context_parallel
    widen = max(_itemsize(request.dtype), 4) / _itemsize(request.dtype)
    others = math.ceil(request.context * (cp - 1) / cp)
    return int(state_size(config, request.dtype).bytes_per_token * others * widen)


def _rows_per_layer(config: PretrainedConfig, request: PlanRequest, positions: int) -> int:
    """The widest growing layer's rows of ``positions`` positions (attention K/V, MLA latents, DSA index keys)."""
    per_layer = adapter_class(config).layer_state_bytes(config, _itemsize(request.dtype))
    return max(per_token for per_token, _ in per_layer) * positions


def capture_rows_bytes(config: PretrainedConfig, request: PlanRequest, rollout: bool = False) -> int:
    """The largest sharded capture over cp ranks (``ShardedCapture``), per rank — the shared context's, or a
    member's history captured sharded after it (``PlanRequest.sharded_history``): it runs layer-major across the
    rank's chunks, holding the hidden states of all its positions between layers, and receives one layer's rows at a
    time to attend to, dropped after the cell: the other ranks' new rows before the cell
    (``PlanRequest.captured_shards``) and their rows of the context before it. ``rollout``: a sampler's, which
    keeps no graphs (a kept-graph budget leaves its captures sharded) and no layer inputs (its cut balanced)."""
    if not (request.sampler_shards if rollout else request.sharded_extends):
        return 0
    captures = [(0, request.context, request.engine.balanced_captures if rollout else request.balanced_context)]
    if request.sharded_history:  # (the context before it, its positions, how it is cut)
        captures.append((_history_before(request), request.sharded_history, request.balanced_history))
    return max(_capture_bytes(config, request, before, n, balanced) for before, n, balanced in captures)


def _capture_bytes(config: PretrainedConfig, request: PlanRequest, before: int, n: int, balanced: bool) -> int:
    cp = request.context_parallel
    own = math.ceil(n / cp)
    received = math.ceil(own * request.captured_shards(balanced)) + math.ceil(before * (cp - 1) / cp)
    return own * config.hidden_size * _itemsize(request.dtype) + _rows_per_layer(config, request, received)


def layer_inputs_bytes(config: PretrainedConfig, request: PlanRequest, positions: int) -> tuple[int, int]:
    """Exact mode's wavefront walk (cp > 1), per rank: what the capture keeps — one hidden vector per position of the
    shard at every k-th layer and after the last — and what the walk holds for the segment of k layers it is in:
    the inputs it recomputes (k - 1: the first is kept; paced, up to ``cp - 1`` more: ``PlanRequest.paced_walk``),
    and one cell's rows of the other ranks before its run (``PlanRequest.captured_shards``: in rank order the last
    rank's N - 1 shards) with their fp32 gradient sinks. None with a kept-graph budget: the capture then runs
    replicated (docs/distributed.md)."""
    if not request.wavefront:
        return 0, 0
    layers = config.num_hidden_layers
    every = layer_inputs_spacing(layers, request.engine)
    itemsize = _itemsize(request.dtype)
    widen = max(itemsize, 4) / itemsize
    walked = positions
    received = math.ceil(positions * request.captured_shards(request.balanced_context))  # a cell's others' rows
    if request.walked_back_sharded:  # the largest walk: a member's history, the other ranks' rows before it too
        cp, before = request.context_parallel, _history_before(request)
        walked = math.ceil(request.sharded_history / cp)
        shards = request.captured_shards(request.balanced_history)
        received = math.ceil(walked * shards) + math.ceil(before * (cp - 1) / cp)
    rows = _rows_per_layer(config, request, received) * (1 + widen)  # one cell's at a time, with their sinks
    kept = LayerInputs.planned_nbytes(positions, config.hidden_size, itemsize, layers, every)
    # a segment holds its first layer's kept input and recomputes the k - 1 after it (paced: a later run holds
    # those of the segment before as well, as many as the steps it trails the first run: cp - 1 a rank, its runs
    # together)
    held = min(every - 1 + (request.context_parallel - 1 if request.paced_walk else 0), layers - 1)
    return kept, walked * config.hidden_size * itemsize * held + int(rows)


def _history_before(request: PlanRequest) -> int:
    """The path before a member's history extended sharded: the context (its first extend), or — every turn
    sharded by ``sharded_extend_tokens`` — the rest of the path before its last."""
    n = request.sharded_history
    return request.context + request.history - n if request.shards_by_threshold(n) else request.context


@dataclass(frozen=True)
class _Probe:
    """One simulated step on a cut model: its graph bytes (peak minus the exact terms) and its parameter counts."""

    graphs: int
    parameters: int
    largest_layer: int
    root: int  # parameters outside the decoder layers: embeddings, final norm, LM head
    layers: int  # decoder layers
    capture: int = 0  # a capture's working set beyond its state (``capture_working_set``)
    routed: tuple[int, ...] = ()  # per decoder layer, its routed experts' parameters (a mixture of experts')
    in_layers: tuple[int, ...] = ()  # per decoder layer, its parameters
    trained: int | None = None  # of ``parameters``, those that train (a LoRA policy's adapters; None: all)
    trained_root: int | None = None  # of ``root``, those that train
    trained_layer: int | None = None  # the most that train in one decoder layer
    head_trains: bool = True  # the LM head's weight takes a gradient (its own, or an adapter's through it)

    @property
    def gradients(self) -> int:
        """The parameters that take a gradient and optimizer state."""
        return self.parameters if self.trained is None else self.trained

    @property
    def root_gradients(self) -> int:
        return self.root if self.trained_root is None else self.trained_root

    def layer_gradients(self, request: PlanRequest) -> int:
        """The most gradient one decoder layer holds whole (``whole_layer``'s gather, all of it trained)."""
        return self.whole_layer(request)[0] if self.trained_layer is None else self.trained_layer

    def whole_layer(self, request: PlanRequest) -> tuple[int, int]:
        """The layer whose parameters are the most at once while it computes, as (what its gather makes whole,
        what its MoE computes of the rank's own experts): the largest layer whole; under expert parallelism a
        layer's gather leaves its routed experts out (each rank's are whole already, the others' never gathered)
        and its MoE holds the rank's share of them — a dense layer may gather more, a MoE layer hold more."""
        if not request.expert_parallel:
            return self.largest_layer, 0
        return max(self._parts(request), key=sum)

    def _parts(self, request: PlanRequest) -> list[tuple[int, int]]:
        cp = request.context_parallel
        return [(n - r, -(-r // cp)) for n, r in zip(self.in_layers, self.routed, strict=True)]

    def layer_moment(self, request: PlanRequest, copies: float) -> tuple[int, int]:
        """(The most a gather makes whole, the most a layer holds at its moment): where a layer's gather holds its
        buffer beside its weights, or under expert parallelism a MoE layer holds ``copies`` of the rank's experts
        beside its gathered part. Without expert parallelism, the largest layer and twice it."""
        if not request.expert_parallel:
            return self.largest_layer, 2 * self.largest_layer
        parts = self._parts(request)
        return max(g for g, _ in parts), max(max(2 * g, g + int(copies * e)) for g, e in parts)


def probe(config: PretrainedConfig, request: PlanRequest, group: int) -> _Probe:
    """Simulate a step of ``group`` members on ``config`` over two chunks of context, and a capture of them."""
    model = meta_model(config, request.dtype, request.lora)
    routed = [_routed_experts(layer) for layer in model.model.layers]
    if request.expert_parallel and not any(routed):
        raise ValueError("expert parallelism needs a mixture of experts; the model has no MoE layer (mlp.experts)")
    graphs = _graphs(model, request, group)
    parameters = sum(p.numel() for p in model.parameters())
    in_layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    capture = capture_working_set(model, request, _probe_prompt(request))
    root = parameters - sum(in_layers)
    layers = len(in_layers)
    trained_in = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in model.model.layers]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = model.lm_head
    head_trains = bool(lora_layers(head)) or head.weight.requires_grad
    if request.lora is None:  # all trains: the layer's gradient is what its gather makes whole (``whole_layer``)
        return _Probe(graphs, parameters, max(in_layers), root, layers, capture, tuple(routed), tuple(in_layers))
    return _Probe(
        graphs, parameters, max(in_layers), root, layers, capture, tuple(routed), tuple(in_layers),
        trained, trained - sum(trained_in), max(trained_in), head_trains,
    )  # fmt: skip


def _routed_experts(layer: Any) -> int:
    """A decoder layer's routed experts' parameters (``mlp.experts``: 0 for a dense MLP)."""
    return sum(p.numel() for name, p in layer.named_parameters() if name.startswith("mlp.experts."))


def _probe_prompt(request: PlanRequest) -> int:
    """The prompt a probe simulates: two chunks of context, then the token that starts every branch."""
    return 2 * request.engine.chunk_size + 1


def _graphs(model: Any, request: PlanRequest, group: int) -> int:
    """A step's peak on the meta ``model`` less the terms the plan counts from the engine's own accounting."""
    prompt_len = _probe_prompt(request)
    peak = step_peak(model, request, prompt_len, group)
    exact = exact_terms(model.config, replace(request, history=0, turns=1), prompt_len - 1)  # (the probe's group)
    return peak - (exact.state + exact.dstate + exact.checkpoints + exact.reference_state)


def extrapolated(config: PretrainedConfig, request: PlanRequest) -> tuple[_Probe, str]:
    """The full model's graph bytes and parameters from models cut to one and two layer periods (all layers when
    the model has no more), simulated with two members; the group's own growth (G members instead of two) is
    measured on the smallest cut and added."""
    head, period = layer_period(config)
    n1, n2, full = head + period, head + 2 * period, config.num_hidden_layers
    pair = min(request.group, 2)
    if full <= n2:
        whole = probe(config, request, pair)
        t1, t2, scale, how = whole, whole, 0.0, f"simulated all {full} layers"
        small = config
    else:
        small = with_layers(config, n1)
        t1, t2 = probe(small, request, pair), probe(with_layers(config, n2), request, pair)
        scale = (full - n1) / period
        how = f"simulated {n1} and {n2} of {full} layers (period {period}) and extrapolated linearly"
    growth = (
        _graphs(meta_model(small, request.dtype, request.lora), request, request.group) - t1.graphs
        if request.group > pair
        else 0
    )
    graphs = int(t1.graphs + (t2.graphs - t1.graphs) * scale) + growth
    parameters = int(t1.parameters + (t2.parameters - t1.parameters) * scale)
    trained = int(t1.gradients + (t2.gradients - t1.gradients) * scale)
    capture = _capture_extrapolated(config, request, t2.capture, n2, period)
    probed = _Probe(
        graphs, parameters, t2.largest_layer, t2.root, full, capture, t2.routed, t2.in_layers,
        trained, t2.trained_root, t2.trained_layer, t2.head_trains,
    )  # fmt: skip
    return probed, how + f"; G={request.group} adds {growth / GIB:.3f} GiB"


def _capture_extrapolated(config: PretrainedConfig, request: PlanRequest, at_n2: int, n2: int, period: int) -> int:
    """A capture's working set on the full model from the one cut to ``n2`` layers (two periods). A sharded capture
    writes each layer's new entries as it goes: one layer's working set at a time, whatever the depth. A capture
    chunk by chunk (one rank, or replicated) holds a chunk's new entries of every layer until the chunk is
    recorded: it grows by a period's entries per period, measured between ``n2`` and ``n2 + period`` layers (not
    from one period: there the only layer is the last, which computes its entries alone)."""
    full = config.num_hidden_layers
    if full <= n2 or request.sharded_extends:
        return at_n2
    at_n3 = capture_working_set(
        meta_model(with_layers(config, n2 + period), request.dtype, request.lora), request, _probe_prompt(request)
    )
    return int(at_n2 + (at_n3 - at_n2) * (full - n2) / period)


CAPTURE, BACKWARD = "capture", "backward"  # the step's two phases (``parameter_phases``)
SAMPLING = "sampling"  # the rollouts between steps (``rollout_terms``)


def parameter_phases(probed: _Probe, request: PlanRequest) -> dict[str, dict[str, int]]:
    """What the trainer holds of the parameters per GPU in each phase of a step, as ``parallel.fsdp`` runs FSDP2
    over all GPUs (dp x cp): shards of the master weights, of their gradients and of AdamW's two moments, in the
    master dtype (fp32 with mixed precision, else the model's); what is whole at once in the compute dtype
    (``_whole_at_once``); and the KL reference (``_reference_weights``). The phases: a capture (no gradient of its
    own) and the backward passes."""
    shard = -(-probed.parameters // request.shard_ranks)
    trained = -(-probed.gradients // request.shard_ranks)
    master = request.master_itemsize
    adam = request.optimizer == "adamw"
    on_gpu = 0 if request.offload else 1  # offloaded: the shards, their gradients and AdamW's state are the host's
    phases = {}
    for phase, (whole_weights, whole_gradients, gradient_shards) in _whole_at_once(probed, request).items():
        phases[phase] = {
            "weights": shard * master * on_gpu,
            "gathered weights": whole_weights,
            "gradients": -(-gradient_shards // request.shard_ranks) * master * on_gpu,
            "gathered gradients": whole_gradients,
            "optimizer state": 2 * master * trained * on_gpu if adam else 0,
            "reference weights": _reference_weights(probed, request),
            "lane buffers (dp > 1)": _lane_buffers(probed, request, phase),
        }
    return phases


def _lane_buffers(probed: _Probe, request: PlanRequest, phase: str) -> int:
    """Sharded over every rank at dp > 1, each dp rank gathers and reduces for itself (``parallel.lanes``): where
    gathers are started ahead — a sharded capture (the step's, or the sampler's: ``SAMPLING``): those started as
    they fall due (``capture_gathers_ahead``); exact mode's wavefront walk: ``walk_gathers_ahead`` of them —
    each holds its send buffer (the rank's shard copied once per cp rank of its dp rank: 1/dp of a layer, in the
    compute dtype) until it completes, and in the walk each asynchronous reduction in flight (as many in rank order,
    one paced) the rows it receives from the cp ranks (1/dp of a layer, in the master dtype); a branch replay
    gathers when it computes, and
    nothing of this outlives the gather. What a rank holds serving the other dp ranks (per dp rank, its shard packed
    for a gather and copied once per cp rank, or one parameter's rows of a reduced gradient: up to (cp + 1)/(dp·cp)
    of a layer while it lasts, (dp - 1) times at once at worst) comes and goes with the other dp ranks' progress,
    and is not planned; the rows they reduce to it wait on the host (``host_terms``)."""
    dp = request.data_parallel
    if request.hsdp or dp == 1 or not request.sharded or (phase == BACKWARD and not request.wavefront):
        return 0
    window = reductions = request.walk_gathers_ahead
    if request.paced_walk:
        reductions = 1  # (``LayerGather.reduce`` lands the one before first)
    if phase == SAMPLING:  # the sampler's captures (keeping no layer inputs)
        window = request.capture_gathers_ahead(request.engine.balanced_captures)
    elif phase != BACKWARD:  # a capture's gathers started ahead of its cell
        window = max(request.capture_gathers_ahead(balanced) for balanced in request.step_capture_cuts())
    share = -(-probed.largest_layer // dp)
    ahead = window * share * _itemsize(request.dtype)
    return ahead + (reductions * share * request.master_itemsize if phase == BACKWARD else 0)


def _reference_weights(probed: _Probe, request: PlanRequest) -> int:
    """The KL reference's weights on a GPU during a step (beta > 0): its shards (``_reference_shards``) and, sharded,
    what the step holds whole in the compute dtype — the root unit (the step gathers a layer at a time: its layers are
    whole only while it scores, never at the policy's peak)."""
    shards = _reference_shards(probed, request)
    if request.beta == 0 or not request.sharded:
        return shards
    return shards + probed.root * _itemsize(request.dtype)


def _reference_shards(probed: _Probe, request: PlanRequest) -> int:
    """What a GPU keeps of the KL reference between steps (beta > 0): unsharded the whole frozen copy; sharded,
    FSDP2 shards it as the policy (``trainer._reference_sharding``): its shards in the compute dtype (frozen, it
    needs no master weights), on the host when offloaded (``host_terms``)."""
    if request.beta == 0:
        return 0
    if not request.sharded:
        return probed.parameters * request.master_itemsize
    return 0 if request.offload else _reference_shard(probed, request)


def _reference_shard(probed: _Probe, request: PlanRequest) -> int:
    """A GPU's shard of the KL reference, in the compute dtype."""
    return -(-probed.parameters // request.shard_ranks) * _itemsize(request.dtype)


def host_terms(probed: _Probe, request: PlanRequest) -> dict[str, int]:
    """What a GPU's process keeps on the host: with ``offload`` (FSDP2's CPU offload policy) its master shards,
    their gradients once the step has reduced them all, AdamW's two moments, and the KL reference's shards; sharded
    over every rank at dp > 1 (``parallel.lanes``), the rows of the gradient each other dp rank reduced to it, summed
    there until the step's end (in one order, whatever the timing)."""
    shard = -(-probed.parameters // request.shard_ranks) * request.master_itemsize
    trained = -(-probed.gradients // request.shard_ranks) * request.master_itemsize
    lanes = 0 if request.hsdp or not request.sharded else (request.data_parallel - 1) * trained
    host = {"other dp ranks' gradient rows": lanes} if lanes else {}
    if not request.offload:
        return host
    adam = 2 * trained if request.optimizer == "adamw" else 0
    host |= {"weights": shard, "gradients": trained, "optimizer state": adam}
    return host | {"reference weights": _reference_shard(probed, request) if request.beta > 0 else 0}


def _whole_at_once(probed: _Probe, request: PlanRequest) -> dict[str, tuple[int, int, int]]:
    """Per phase of the step, by the trainer's schedule: the weights and gradients whole at once, and how many
    parameters' gradient shards are held beside them. Unsharded (one GPU, or no ``fsdp``): with mixed precision the
    compute copy (its gradients handed to the masters as they accumulate); over cp ranks, exact mode's wavefront walk
    sums the gradient over them in flat buckets (``GRADIENT_BUCKET_BYTES``), the largest a copy of the gradient's
    first parameters (counted as gathered gradients). Sharded, a layer at a time
    (``parallel.fsdp``; at dp > 1 without HSDP each dp rank for itself, ``parallel.lanes``): the root unit
    (embeddings, final norm, LM head) for the step, its gradient whole until the step ends (so only the decoder
    layers' gradient shards exist beside it); in a sharded capture over the cp ranks the cell's layer and the
    gathers started ahead of it (``PlanRequest.capture_layers_whole``; a replicated one gathers each layer as it
    computes); in the backward passes one layer and its gradient (branch replays; copied to the master dtype before
    its reduction under mixed precision), or in exact mode's wavefront walk the window's layers and their gradients
    on their way to the shards (reduced asynchronously, in the master dtype), each with the root's gradient. Under
    expert parallelism a gather leaves out the routed experts, and a MoE call holds the rank's own experts of the
    layer in the compute dtype where they are cast (mixed precision, offload), and its backward the copy again, then
    (the copy freed) the gradient's master copy and the shard's gradient plus it, a stacked weight at a time
    (counted as gradients; the gradient itself is part of the measured graph). A step starts with no gradient: a
    capture holds one only after another group's backward in the same step (``groups_per_rank`` > 1)."""
    compute, master = _itemsize(request.dtype), request.master_itemsize
    later = request.groups_per_rank > 1  # a capture after another group's backward, in the same step
    if not request.sharded:
        copy = probed.parameters * compute if request.mixed else 0
        # over whole weights the wavefront walk ends summing the parameter gradient over cp, a flat bucket at a time
        summed = min(probed.gradients * compute, GRADIENT_BUCKET_BYTES) if request.wavefront else 0
        return {CAPTURE: (copy, 0, probed.gradients if later else 0), BACKWARD: (copy, summed, probed.gradients)}
    layer, experts = probed.whole_layer(request)
    graded, root_graded = probed.layer_gradients(request), probed.root_gradients  # (a LoRA policy: its adapters')
    # expert parallelism: what a MoE call holds of the rank's own experts beyond what the probe measures (their
    # gradient in the compute dtype, one stacked tensor per projection): their compute copy where they are cast
    # (mixed precision, offload), in forward and again in backward; then their gradient on its way into the shards
    cast = int(_expert_copies(request) * experts * compute)
    expert_gradient = max(cast, _expert_gradient_into_shards(request, experts) if request.lora is None else 0)
    ahead = _step_layers_whole(request, probed.layers)
    capture = (ahead * layer + probed.root) * compute + cast
    if request.wavefront:
        weights = (_walk_layers_whole(request, probed.layers) * layer + probed.root) * compute + cast
        in_flight = min(prefetch_window(request.context_parallel), probed.layers - 1) * graded * master
        if request.paced_walk:  # the gradients a rank keeps until their waves' reductions, and one in flight: under
            # mixed precision a master-dtype copy; otherwise a kept gradient handed over, freed as the reduction
            # completes (every rank posts it once it is done with it; measured: tests/test_planner_distributed.py)
            kept = min(request.context_parallel - 1, probed.layers - 1) * graded * compute
            in_flight = kept + (graded * master if request.mixed else 0)
    else:
        weights = (layer + probed.root) * compute
        in_flight = graded * master if request.mixed else 0
    gradients = in_flight + (graded + root_graded) * compute + expert_gradient
    layers_only = probed.gradients - root_graded
    earlier = (root_graded * compute, layers_only) if later else (0, 0)  # the root's gradient whole, the layers' shards
    return {CAPTURE: (capture, *earlier), BACKWARD: (weights, gradients, layers_only)}


def _step_layers_whole(request: PlanRequest, layers: int) -> int:
    """The decoder layers the step's captures hold whole at once (the most of the context's and a history's)."""
    return max(_layers_whole(request, layers, request.sharded_extends, b) for b in request.step_capture_cuts())


def _walk_layers_whole(request: PlanRequest, layers: int) -> int:
    """Exact mode's wavefront walk: the layer it walks and the gathers it starts ahead (``prefetch_window``;
    paced, ``PlanRequest.walk_gathers_ahead``)."""
    return min(request.walk_gathers_ahead + 1, layers)


def _layers_whole(request: PlanRequest, layers: int, sharded: bool, balanced: bool) -> int:
    """The decoder layers whole at once in a capture: a sharded one's (``PlanRequest.capture_layers_whole``, no more
    than the model's layers); one that is not gathers each layer as it computes."""
    return min(request.capture_layers_whole(balanced), layers) if sharded else 1


GATE_UP_SHARE = 2 / 3  # of an expert's parameters: gate_up_proj [2I, H] beside down_proj [H, I]


def _expert_gradient_into_shards(request: PlanRequest, experts: int) -> int:
    """Under expert parallelism, what a MoE call's backward holds beyond its gradient in the compute dtype while
    that gradient goes into the rank's shards (``ExpertShard.add_gradients``), one stacked weight at a time and
    ``gate_up_proj`` (the larger) first, the compute copy of the experts freed by then: its master-dtype copy (mixed
    precision), then on the device (not offloaded) the shard's gradient plus it, its compute-dtype gradient freed
    once copied (offloaded, the sum is the host's)."""
    compute, master = _itemsize(request.dtype), request.master_itemsize
    first = GATE_UP_SHARE * experts
    copied = first * master if request.mixed else 0.0
    if request.offload:
        return round(copied)
    summed = first * master - (first * compute if request.mixed else 0.0)  # (the sum, less the freed compute one)
    return round(copied + summed)


def _expert_copies(request: PlanRequest, sampling: bool = False) -> float:
    """Under expert parallelism, a MoE call's copy of the rank's experts, in units of their compute-dtype bytes: none
    where they are used in place, one cast (mixed precision) or copy in (offload). Offloaded masters in a wider
    dtype are copied in, then cast on the device, one stacked weight at a time: ``gate_up_proj`` (2/3 of an
    expert's parameters) in both dtypes for a moment, then ``down_proj``'s copy beside both casts — the most a MoE
    call holds while sampling (no gradient); a step's backward holds more later (its gradient, beside the cast
    alone)."""
    if request.offload and request.mixed and sampling:
        wider = request.master_itemsize / _itemsize(request.dtype)
        return max(2 / 3 * (1 + wider), 1 + wider / 3)
    return 1.0 if request.offload or request.mixed else 0.0


def logits_bytes(config: PretrainedConfig, request: PlanRequest) -> int:
    """What the LM head's log-probs hold at once (part of the measured graphs): three logit tiles, and the head's
    weight gradient in fp32 and in the model's dtype before it joins the sharded gradients."""
    head = config.vocab_size * config.hidden_size
    return 3 * DEFAULT_TILE_ELEMENTS * 4 + head * (4 + _itemsize(request.dtype))


@dataclass(frozen=True)
class _Measured:
    """What a plan measures once per request and reuses for every context length."""

    config: PretrainedConfig
    parameters: dict[str, dict[str, int]]  # per phase
    graphs: int
    how: str
    rollout_whole: tuple[int, int]  # parameters whole while sampling, and a layer's moment (``_whole_in_rollouts``)
    host: dict[str, int]  # offloaded (``host_terms``)
    apart: int = 0  # of the graph term, what a backward never holds beside a whole layer (``_never_beside_a_layer``)
    capture: int = 0  # a capture's working set (``capture_working_set``)
    reference: int = 0  # the KL reference's shards kept between steps (``_reference_shards``)
    rollout_lanes: int = 0  # the sampler's capture's lane buffers at dp > 1 (``_lane_buffers``)
    gradient_shards: int | None = None  # the gradients' shards a GPU keeps (None: as many bytes as its weights')


def _measure(request: PlanRequest) -> _Measured:
    config = load_config(request.model)
    probed, how = extrapolated(config, request)
    phases = parameter_phases(probed, request)
    return _Measured(
        config,
        phases,
        probed.graphs,
        how,
        _whole_in_rollouts(probed, request),
        host_terms(probed, request),
        _never_beside_a_layer(config, probed, request),
        probed.capture,
        _reference_shards(probed, request),
        _lane_buffers(probed, request, SAMPLING) if request.sampler_shards else 0,
        -(-probed.gradients // request.shard_ranks) * request.master_itemsize * (0 if request.offload else 1),
    )


def _never_beside_a_layer(config: PretrainedConfig, probed: _Probe, request: PlanRequest) -> int:
    """Where a step gathers a layer at a time, the LM head's weight-gradient buffers (fp32, and the model's dtype
    before they join the root's gradient: part of the measured graph term) and a decoder layer with its gradient
    are never whole at once — the head's backward ends before any layer's begins — so the backward phase holds the
    larger of the two, not both: the smaller comes off its graph term."""
    if not request.sharded or not probed.head_trains:
        return 0
    head = config.vocab_size * config.hidden_size * (4 + _itemsize(request.dtype))
    return min(head, (probed.whole_layer(request)[0] + probed.layer_gradients(request)) * _itemsize(request.dtype))


def _whole_in_rollouts(probed: _Probe, request: PlanRequest) -> tuple[int, int]:
    """The parameters whole while a rank samples (``Run.sampling_weights``) — unsharded none (mixed precision: the
    compute copy); sharded, the root unit and the layers a sharded capture gathers ahead (``prefetch_window``; one
    over one cp rank) — and, in compute-dtype parameters, what the layer computing adds for a moment: the buffer of
    its gather (FSDP2's all-gather output its weights are copied from) or, after it, under expert parallelism the
    MoE's copy of the rank's experts (``_expert_copies``; the layer with the most of either)."""
    if not request.sharded:
        return (probed.parameters if request.mixed else 0), 0
    # the prompt's sharded capture gathers ahead, as the step's (``_whole_at_once``)
    layers = _layers_whole(request, probed.layers, request.sampler_shards, request.engine.balanced_captures)
    layer, moment = probed.layer_moment(request, _expert_copies(request, sampling=True))
    return probed.root + layers * layer, moment - layer


def _phase_categories(measured: _Measured, exact: _Exact) -> dict[str, dict[str, int]]:
    """Each phase's bytes by category. Both hold the state, the kept layer inputs and a measured working set (the
    backward passes a graph: the larger of a chunk's and a branch's; a capture its no-grad chunk's, under the same
    category name); only a sharded capture holds its layer-major hidden states and the
    earlier ranks' rows it receives, only the backward passes the state gradient and the walk's recomputed segment
    (recurrent checkpoints are made by the capture and kept)."""
    phases = {}
    for phase, parameters in measured.parameters.items():
        backward = phase == BACKWARD
        phases[phase] = {
            **parameters,
            "captured state": exact.state,
            "reference state": exact.reference_state,
            "dState": exact.dstate if backward else 0,
            "other ranks' context rows' gradient": exact.context_grads if backward else 0,
            "recurrent checkpoints": exact.checkpoints,
            "layer inputs (wavefront walk)": exact.layer_inputs if backward else exact.layer_inputs_kept,
            "sharded capture (hidden, earlier rows)": 0 if backward else exact.capture_rows,
            "one chunk's or branch's graph": measured.graphs - measured.apart if backward else measured.capture,
        }
    return phases


def rollout_terms(measured: _Measured, request: PlanRequest) -> dict[str, int]:
    """What a rank holds while ``longstraw train`` samples in process (``app.training``): the shards, the last
    step's gradient shards and AdamW's state, what is gathered in the compute dtype (``_whole_in_rollouts``: a
    collective, so every rank of the shard group holds it), one decode step's fp32 logits per member, and the
    sampler's state. With cp > 1 the cp ranks sample together (``parallel.sampling``), each holding its share of
    the prompt (cut evenly) and of the members' own tokens (each turn on the rank holding the least of the path,
    ties spread over the ranks), each member's turn while it is decoded (every rank computes it), and the largest
    sharded capture's rows (``capture_rows_bytes``; a decode step reads only the rows a rank holds) and working
    set. On one GPU the whole prompt and every member's tokens, and one layer's rows of the whole context gathered
    for attention (a chunk attends to all earlier rows at once). A gather's buffer and the rows are never held at
    once (a layer is gathered before it computes): the larger counts, the gather's beyond the rows under gathered
    weights."""
    compute = _itemsize(request.dtype)
    parameters = measured.parameters[BACKWARD]
    whole, buffer = (n * compute for n in measured.rollout_whole)
    cp, config = request.context_parallel, measured.config
    if cp == 1:
        rows, working = _rows_per_layer(config, request, request.context + request.history), 0  # the last turn's
    else:
        rows, working = capture_rows_bytes(config, request, rollout=True), measured.capture
    size = state_size(config, request.dtype)
    held = math.ceil(request.context / cp) + math.ceil(request.group * request.own_tokens / cp)
    return {
        "weights": parameters["weights"],
        # every shard's, kept until the next step zeroes them (a LoRA policy's: its adapters')
        "gradients": parameters["weights"] if measured.gradient_shards is None else measured.gradient_shards,
        "optimizer state": parameters["optimizer state"],
        "reference weights": measured.reference,  # (its root, whole for a step, resharded after it)
        "gathered weights": whole + max(0, buffer - rows),
        "lane buffers (dp > 1)": measured.rollout_lanes,
        "sampler state": size.bytes_per_token * held + (1 + request.group) * size.fixed_bytes,
        # a decode session's buffers: every rank computes each member's turn (``decoding.Decoder``)
        "decoded turns": size.bytes_per_token * request.group * (request.completion + 1),
        "attention's earlier rows": rows,
        "a capture's working set": working,
        "logits": request.group * config.vocab_size * 4,
    }


def _phase_note(peak: str, most: int, other: int) -> str:
    if most == other:
        return "the step's capture and backward phases hold the same"
    return f"the step's peak is in its {peak} phase (the other holds {other / GIB:.2f} GiB before the margin)"


def _plan(request: PlanRequest, measured: _Measured) -> Plan:
    positions = math.ceil((request.context + request.history) / request.context_parallel)  # one member's path
    exact = exact_terms(measured.config, request, positions)
    phases = _phase_categories(measured, exact)
    peak = max(phases, key=lambda phase: sum(phases[phase].values()))
    categories = phases[peak]
    other = sum(min(phases.values(), key=lambda c: sum(c.values())).values())
    notes = [
        f"graphs: {measured.how}, 2 chunks of {request.engine.chunk_size} positions on the meta device; they include "
        "the LM head's log-prob tiles and its fp32 weight gradient "
        f"({logits_bytes(measured.config, request) / GIB:.2f} GiB; none where the head is frozen)",
        f"context per rank {positions:,} (cp = {request.context_parallel}, taken analytically"
        + ("; the shared context and one member's history, both spread over the ranks" if request.history else "")
        + "); "
        + _sharding_note(request, measured.config.num_hidden_layers),
        _phase_note(peak, sum(categories.values()), other),
    ]
    if request.lora is not None:
        lora = request.lora
        notes.append(
            f"LoRA r={lora.r} on {lora.target_modules}: gradients and AdamW state for the adapters alone "
            f"({(measured.gradient_shards or 0) / GIB:.3f} GiB of gradient shards a GPU); every weight kept, frozen"
        )
    if request.mode == "exact":
        spacing = checkpoint_spacing(measured.config, request.dtype, request.engine)
        notes.append(f"recurrent checkpoints every {spacing} chunks; the state gradient in fp32")
        if request.context_parallel > 1:
            walk = "wavefront (layer inputs kept)" if request.wavefront else "replicated (no layer inputs)"
            notes.append(f"the reverse walk over the cp ranks: {walk}")
    return Plan(request, categories, notes, rollout_terms(measured, request), measured.host)


def _sharding_note(request: PlanRequest, layers_in_model: int) -> str:
    master = "fp32 master weights" if request.mixed else f"{str(request.dtype).removeprefix('torch.')} weights"
    adam = f"AdamW state (2 x {request.master_itemsize} B)" if request.optimizer == "adamw" else "no optimizer state"
    if not request.sharded:
        copy = ", a compute copy" if request.mixed else ""
        where = "one GPU:" if request.gpus == 1 else "not sharded (no fsdp): every GPU holds the"
        return f"{where} {master}{copy}, their gradients and {adam}"
    layers = _step_layers_whole(request, layers_in_model)
    if request.wavefront:
        layers = max(layers, _walk_layers_whole(request, layers_in_model))
    whole = f"the root unit and up to {layers} decoder layers whole at once (a layer at a time)"
    over = "each dp rank's cp GPUs (HSDP: replicated over dp)" if request.hsdp else "all GPUs"
    where = " on the host (CPU offload; AdamW steps there)" if request.offload else ""
    experts = ""
    if request.expert_parallel:
        extends = (
            "long extends sharded, their tokens dispatched to their experts' ranks"
            if request.dispatched
            else "every extend replicated"
        )
        experts = f"; expert parallelism: each cp rank holds whole experts, never gathered, {extends}"
    return f"FSDP2 shards {master}, their gradients and {adam} over {over}{where}; {whole}{experts}"


def plan_memory(request: PlanRequest) -> Plan:
    """The peak per GPU of one GRPO step of ``request``, by category."""
    return _plan(request, _measure(request))


def is_mixture_of_experts(config: PretrainedConfig) -> bool:
    """Whether ``config``'s model has routed experts (``mlp.experts``), found on its first layer period (meta)."""
    head, period = layer_period(config)
    cut = with_layers(config, min(head + period, config.num_hidden_layers))
    return any(_routed_experts(layer) for layer in meta_model(cut, torch.bfloat16).model.layers)


def expert_parallel_alternative(request: PlanRequest) -> PlanRequest | None:
    """For a mixture of experts planned without expert parallelism, the same step laid out as the published one
    fits: each cp rank holding whole experts, never gathered, the masters offloaded (HSDP at dp > 1); None where that
    does not apply (expert parallelism already, one cp rank, a model without experts)."""
    if request.expert_parallel or request.context_parallel == 1:
        return None
    if not is_mixture_of_experts(load_config(request.model)):
        return None
    hsdp = request.hsdp or request.data_parallel > 1
    return replace(request, fsdp=True, expert_parallel=True, offload=True, hsdp=hsdp)


def longest_context(request: PlanRequest, low: int = 1024, high: int = CONTEXT_SEARCH_LIMIT) -> tuple[int, Plan]:
    """The longest context that fits ``request``'s GPUs, by binary search (the graphs are measured once: they do
    not depend on the context). Returns 0 when not even ``low`` fits, and ``high - 1`` when every length below
    ``high`` fits: the search's bound (``CONTEXT_SEARCH_LIMIT`` by default), not a limit of the memory."""
    measured = _measure(request)

    def fits(context: int) -> bool:
        return _plan(replace(request, context=context), measured).fits

    if not fits(low):
        return 0, _plan(replace(request, context=low), measured)
    while low < high - 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, _plan(replace(request, context=low), measured)
