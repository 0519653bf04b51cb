"""The memory planner: the peak per GPU of a GRPO step before renting the GPUs (``longstraw plan``).

It runs the project's real engine and trainer code — capture, branch replay, exact mode's reverse walk — on the meta
device under ``MemoryTracker`` (``CachedMemoryTracker``: an op computed once per layout of its inputs, the same bytes
in about half the time): tensors have shapes and byte sizes but no storage and no arithmetic (attention takes
the ``meta`` backend, a fused kernel's allocations without its work; a MoE's experts the grouped kernel's, which
do not depend on the routing, except a dispatched round's rows, taken as balanced). Walking
2M tokens x 64 layers in Python would take long, so it simulates a few chunks on models cut to two and three periods
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

The package's modules, one concern each: ``request`` (what to plan), ``configs`` (models, cut and on the meta
device), ``probes`` (the simulated steps), ``growing`` (the exact terms), ``parameters`` (the parameters' terms),
``memory_plan`` (``Plan`` and its table); here the plan is put together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from longstraw_agents.engine import checkpoint_spacing
from longstraw_agents.models import state_size
from longstraw_agents.plan.configs import is_mixture_of_experts, load_config
from longstraw_agents.plan.growing import ExactTerms, capture_rows_bytes, exact_terms, rows_per_layer
from longstraw_agents.plan.memory_plan import GIB, Plan
from longstraw_agents.plan.parameters import (
    BACKWARD,
    SAMPLING,
    host_terms,
    lane_buffers,
    never_beside_a_layer,
    parameter_phases,
    reference_shards,
    step_layers_whole,
    walk_layers_whole,
    whole_in_rollouts,
)
from longstraw_agents.plan.probes import extrapolated, logits_bytes
from longstraw_agents.plan.request import PlanRequest, element_size

CONTEXT_SEARCH_LIMIT = 1 << 26  # longest_context tries lengths below this (67M positions)


@dataclass(frozen=True)
class _Measured:
    """What a plan measures once per request and reuses for every context length."""

    config: PretrainedConfig
    parameters: dict[str, dict[str, int]]  # per phase
    graphs: int
    how: str
    rollout_whole: tuple[int, int]  # parameters whole while sampling, and a layer's moment (``whole_in_rollouts``)
    host: dict[str, int]  # offloaded (``host_terms``)
    apart: int = 0  # of the graph term, what a backward never holds beside a whole layer (``never_beside_a_layer``)
    capture: int = 0  # a capture's working set (``capture_working_set``)
    reference: int = 0  # the KL reference's shards kept between steps (``reference_shards``)
    rollout_lanes: int = 0  # the sampler's capture's lane buffers at dp > 1 (``lane_buffers``)
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
        whole_in_rollouts(probed, request),
        host_terms(probed, request),
        never_beside_a_layer(config, probed, request),
        probed.capture,
        reference_shards(probed, request),
        lane_buffers(probed, request, SAMPLING) if request.sampler_shards else 0,
        -(-probed.gradients // request.shard_ranks) * request.master_itemsize * (0 if request.offload else 1),
    )


def _phase_categories(measured: _Measured, exact: ExactTerms) -> dict[str, dict[str, int]]:
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
    step's gradient shards and AdamW's state, what is gathered in the compute dtype (``whole_in_rollouts``: a
    collective, so every rank of the shard group holds it), one decode step's fp32 logits per member, and the
    sampler's state. With cp > 1 the cp ranks sample together (``parallel.sampling``), each holding its share of
    the prompt (cut evenly) and of the members' own tokens (each turn on the rank holding the least of the path,
    ties spread over the ranks), each member's turn while it is decoded (every rank computes it), and the largest
    sharded capture's rows (``capture_rows_bytes``; a decode step reads only the rows a rank holds) and working
    set. On one GPU the whole prompt and every member's tokens, and one layer's rows of the whole context gathered
    for attention (a chunk attends to all earlier rows at once). A gather's buffer and the rows are never held at
    once (a layer is gathered before it computes): the larger counts, the gather's beyond the rows under gathered
    weights."""
    compute = element_size(request.dtype)
    parameters = measured.parameters[BACKWARD]
    whole, buffer = (n * compute for n in measured.rollout_whole)
    cp, config = request.context_parallel, measured.config
    if cp == 1:
        rows, working = rows_per_layer(config, request, request.context + request.history), 0  # the last turn's
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
    layers = step_layers_whole(request, layers_in_model)
    if request.wavefront:
        layers = max(layers, walk_layers_whole(request, layers_in_model))
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
