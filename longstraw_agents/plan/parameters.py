"""What a GPU holds of the parameters in each phase of a step, as ``parallel.fsdp`` runs FSDP2 over dp x cp: shards
of the master weights, their gradients and AdamW's moments; what is whole at once in the compute dtype (the root
unit, the layers a capture or the walk gathers ahead, a MoE call's experts); the KL reference; the lanes' buffers at
dp > 1; and what the host keeps (offload, other dp ranks' gradient rows).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from longstraw_agents.engine.wavefront import GRADIENT_BUCKET_BYTES
from longstraw_agents.parallel.fsdp import prefetch_window
from longstraw_agents.plan.probes import Probe
from longstraw_agents.plan.request import PlanRequest, element_size

CAPTURE, BACKWARD = "capture", "backward"  # the step's two phases (``parameter_phases``)
SAMPLING = "sampling"  # the rollouts between steps (``rollout_terms``)


def parameter_phases(probed: Probe, request: PlanRequest) -> dict[str, dict[str, int]]:
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
            "lane buffers (dp > 1)": lane_buffers(probed, request, phase),
        }
    return phases


def lane_buffers(probed: Probe, request: PlanRequest, phase: str) -> int:
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
    ahead = window * share * element_size(request.dtype)
    return ahead + (reductions * share * request.master_itemsize if phase == BACKWARD else 0)


def _reference_weights(probed: Probe, request: PlanRequest) -> int:
    """The KL reference's weights on a GPU during a step (beta > 0): its shards (``reference_shards``) and, sharded,
    what the step holds whole in the compute dtype — the root unit (the step gathers a layer at a time: its layers are
    whole only while it scores, never at the policy's peak)."""
    shards = reference_shards(probed, request)
    if request.beta == 0 or not request.sharded:
        return shards
    return shards + probed.root * element_size(request.dtype)


def reference_shards(probed: Probe, request: PlanRequest) -> int:
    """What a GPU keeps of the KL reference between steps (beta > 0): unsharded the whole frozen copy; sharded,
    FSDP2 shards it as the policy (``parallel.parallelize``): its shards in the compute dtype (frozen, it
    needs no master weights), on the host when offloaded (``host_terms``)."""
    if request.beta == 0:
        return 0
    if not request.sharded:
        return probed.parameters * request.master_itemsize
    return 0 if request.offload else _reference_shard(probed, request)


def _reference_shard(probed: Probe, request: PlanRequest) -> int:
    """A GPU's shard of the KL reference, in the compute dtype."""
    return -(-probed.parameters // request.shard_ranks) * element_size(request.dtype)


def host_terms(probed: Probe, request: PlanRequest) -> dict[str, int]:
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


def _whole_at_once(probed: Probe, request: PlanRequest) -> dict[str, tuple[int, int, int]]:
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
    compute, master = element_size(request.dtype), request.master_itemsize
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
    ahead = step_layers_whole(request, probed.layers)
    capture = (ahead * layer + probed.root) * compute + cast
    if request.wavefront:
        weights = (walk_layers_whole(request, probed.layers) * layer + probed.root) * compute + cast
        in_flight = min(prefetch_window(request.context_parallel), probed.layers - 1) * graded * master
        if request.paced_walk:  # the gradients a rank keeps until their waves' reductions, and one in flight: under
            # mixed precision a master-dtype copy; otherwise a kept gradient handed over, freed as the reduction
            # completes (every rank posts it once it is done with it; measured: tests/test_planner_distributed.py)
            kept = min(request.walk_holds().kept, probed.layers - 1) * graded * compute
            in_flight = kept + (graded * master if request.mixed else 0)
    else:
        weights = (layer + probed.root) * compute
        in_flight = graded * master if request.mixed else 0
    gradients = in_flight + (graded + root_graded) * compute + expert_gradient
    layers_only = probed.gradients - root_graded
    earlier = (root_graded * compute, layers_only) if later else (0, 0)  # the root's gradient whole, the layers' shards
    return {CAPTURE: (capture, *earlier), BACKWARD: (weights, gradients, layers_only)}


def step_layers_whole(request: PlanRequest, layers: int) -> int:
    """The decoder layers the step's captures hold whole at once (the most of the context's and a history's)."""
    return max(_layers_whole(request, layers, request.sharded_extends, b) for b in request.step_capture_cuts())


def walk_layers_whole(request: PlanRequest, layers: int) -> int:
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
    compute, master = element_size(request.dtype), request.master_itemsize
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
        wider = request.master_itemsize / element_size(request.dtype)
        return max(2 / 3 * (1 + wider), 1 + wider / 3)
    return 1.0 if request.offload or request.mixed else 0.0


def never_beside_a_layer(config: PretrainedConfig, probed: Probe, request: PlanRequest) -> int:
    """Where a step gathers a layer at a time, the LM head's weight-gradient buffers (fp32, and the model's dtype
    before they join the root's gradient: part of the measured graph term) and a decoder layer with its gradient
    are never whole at once — the head's backward ends before any layer's begins — so the backward phase holds the
    larger of the two, not both: the smaller comes off its graph term."""
    if not request.sharded or not probed.head_trains:
        return 0
    head = config.vocab_size * config.hidden_size * (4 + element_size(request.dtype))
    return min(head, (probed.whole_layer(request)[0] + probed.layer_gradients(request)) * element_size(request.dtype))


def whole_in_rollouts(probed: Probe, request: PlanRequest) -> tuple[int, int]:
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
