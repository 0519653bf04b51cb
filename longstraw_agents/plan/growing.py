"""What grows with the context, counted exactly from the engine's own accounting (``state_size``,
``checkpoint_spacing``, ``LayerInputs``): the state of the rank's positions, exact mode's state gradient (fp32 for
bf16 states), recurrent checkpoints every k chunks, the reference's state, a sharded capture's rows and the wavefront
walk's layer inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from longstraw_agents.engine import LayerInputs, checkpoint_spacing, layer_inputs_spacing
from longstraw_agents.models import adapter_class, state_size
from longstraw_agents.plan.request import PlanRequest, element_size


@dataclass(frozen=True)
class ExactTerms:
    """The terms that grow with the context, from the engine's own accounting."""

    state: int
    dstate: int
    checkpoints: int
    reference_state: int
    layer_inputs: int = 0
    layer_inputs_kept: int = 0  # (of layer_inputs: what the capture keeps, the rest the walk's segment)
    capture_rows: int = 0
    context_grads: int = 0  # the other ranks' context rows' gradient, held until a sharded walk back is done


def exact_terms(config: PretrainedConfig, request: PlanRequest, positions: int) -> ExactTerms:
    """State, its gradient (exact mode: at least fp32), recurrent checkpoints and the reference's state."""
    size = state_size(config, request.dtype)
    state = size.total(positions)
    exact = request.mode == "exact"
    widen = max(element_size(request.dtype), 4) / element_size(request.dtype)
    # (an agent's last answer is replayed with gradient sinks over the whole path before its history is walked)
    dstate = int(size.bytes_per_token * positions * widen) + size.fixed_bytes if exact else 0
    spacing = checkpoint_spacing(config, request.dtype, request.engine)
    checkpoints = size.fixed_bytes * (math.ceil(positions / request.engine.chunk_size) // spacing) if exact else 0
    kept, segment = layer_inputs_bytes(config, request, positions)
    rows = capture_rows_bytes(config, request)
    reference = state if request.beta > 0 else 0
    return ExactTerms(state, dstate, checkpoints, reference, kept + segment, kept, rows, context_grads(config, request))


def context_grads(config: PretrainedConfig, request: PlanRequest) -> int:
    """Exact mode's sharded walk of a member's history back to the context (``WavefrontWalk`` after ``since``): the
    planned cp rank holds the gradient of the other ranks' context rows its queries read until its walk is done
    (fp32 for a bf16 state), summed over its cells: ``(cp - 1) / cp`` of the context's on every rank."""
    if not request.walked_back_sharded:
        return 0
    cp = request.context_parallel
    widen = max(element_size(request.dtype), 4) / element_size(request.dtype)
    others = math.ceil(request.context * (cp - 1) / cp)
    return int(state_size(config, request.dtype).bytes_per_token * others * widen)


def rows_per_layer(config: PretrainedConfig, request: PlanRequest, positions: int) -> int:
    """The widest growing layer's rows of ``positions`` positions (attention K/V, MLA latents, DSA index keys)."""
    per_layer = adapter_class(config).layer_state_bytes(config, element_size(request.dtype))
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
    return own * config.hidden_size * element_size(request.dtype) + rows_per_layer(config, request, received)


def layer_inputs_bytes(config: PretrainedConfig, request: PlanRequest, positions: int) -> tuple[int, int]:
    """Exact mode's wavefront walk (cp > 1), per rank: what the capture keeps — one hidden vector per position of the
    shard at every k-th layer and after the last — and what the walk holds for the segment of k layers it is in:
    the inputs it recomputes (``PlanRequest.walk_inputs_held``: k - 1, the first is kept; paced, a later run's of the
    segment before too), and one cell's rows of the other ranks before its run (``PlanRequest.captured_shards``: in
    rank order the last rank's N - 1 shards) with their fp32 gradient sinks. None with a kept-graph budget: the
    capture then runs replicated (docs/distributed.md)."""
    if not request.wavefront:
        return 0, 0
    layers = config.num_hidden_layers
    every = layer_inputs_spacing(layers, request.engine)
    itemsize = element_size(request.dtype)
    widen = max(itemsize, 4) / itemsize
    walked = positions
    received = math.ceil(positions * request.captured_shards(request.balanced_context))  # a cell's others' rows
    if request.walked_back_sharded:  # the largest walk: a member's history, the other ranks' rows before it too
        cp, before = request.context_parallel, _history_before(request)
        walked = math.ceil(request.sharded_history / cp)
        shards = request.captured_shards(request.balanced_history)
        received = math.ceil(walked * shards) + math.ceil(before * (cp - 1) / cp)
    rows = rows_per_layer(config, request, received) * (1 + widen)  # one cell's at a time, with their sinks
    kept = LayerInputs.planned_nbytes(positions, config.hidden_size, itemsize, layers, every)
    held = request.walk_inputs_held(layers, every)
    return kept, math.ceil(walked * config.hidden_size * itemsize * held) + int(rows)


def _history_before(request: PlanRequest) -> int:
    """The path before a member's history extended sharded: the context (its first extend), or — every turn
    sharded by ``sharded_extend_tokens`` — the rest of the path before its last."""
    n = request.sharded_history
    return request.context + request.history - n if request.shards_by_threshold(n) else request.context
