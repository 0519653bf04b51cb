"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a policy the engine drives.

Each decoder layer is one FSDP unit and the whole model is the root unit (embeddings, final norm, LM head), sharded
along dim 0 over every rank of the job (``ParallelMesh.shard_mesh``: dp x cp flattened, as torchtitan shards over
data and context ranks together): a rank stores 1/(dp·cp) of every parameter, and AdamW steps its shard.

FSDP2 all-gathers a unit's parameters in the unit's forward pre-hook and reduce-scatters its gradients in a
post-backward hook set up by that forward. The engine never calls a module's forward — it calls a layer's
projections, norms and MLP directly (capture, branch replay, the reverse chunk walk) — so none of those hooks fire.
``LayerGather`` does their work explicitly, a decoder layer at a time inside the engine's schedule: it unshards a
unit (``FSDPModule.unshard``) while the engine computes with it, and reshards it and reduce-scatters the gradient
it accumulated on the unsharded parameters into the sharded ones (a ``Partial`` DTensor redistributed to the
parameter's ``Shard(0)``, each rank keeping its shard). The cp ranks of one dp rank compute the same gradient
(every one holds the group's whole gradient after its backward), so a gradient is divided by its number of copies
(``replicas``) before the sum. The schedule uses public APIs (``unshard`` / ``reshard``, DTensor), so FSDP's
internal hook state is never entered; what FSDP2 offers no public accessor for (the mixed-precision and offload
policies) is read through ``parallel.fsdp_state``, the one module that reads its private state.

Schedule: a gather is a collective over the shard mesh. At dp = 1, or with HSDP (sharded over each dp rank's cp
ranks, replicated over dp: ``reduce_replicas`` sums the replicas' gradient shards at the step's end), every rank of
a gather's group is a cp rank of one group, computing in lockstep: ``LayerGather`` as it is, and sampling too (the
cp ranks sample together, ``parallel.sampling``: each joins every gather). Sharded over dp > 1 ranks, whose groups
differ in shape, each dp rank gathers and reduces on a communicator of its own, which the other ranks serve
(``parallel.lanes``). No rank ever holds the whole model or its whole gradient. With CPU offload
(``shard_model(offload=True)``) the shards, their gradients and the optimizer's state live on the host. A served
policy gets the weights assembled a part at a time (``whole_parts``). Under expert parallelism
(``shard_model(experts=True)``) each MoE layer's experts are units of their own nested in the layer's, cut over the
cp ranks and never gathered: ``LayerGather`` gathers a layer without them and ``bind``s the engine's MoE layers to
compute each rank's own (``parallel.experts``, which ``ParallelMesh.sharding`` binds).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Placement

from longstraw_agents.layout import HSDP_WITHOUT_CP as HSDP_WITHOUT_CP  # (`longstraw plan` checks them without torch)
from longstraw_agents.layout import HSDP_WITHOUT_DP as HSDP_WITHOUT_DP
from longstraw_agents.memory import host_placement
from longstraw_agents.models.lora import is_lora_layer
from longstraw_agents.parallel.fsdp_state import mixed_precision_policy, offload_policy

if TYPE_CHECKING:
    from longstraw_agents.engine.weights import ExpertRounds


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
    experts: bool = False,
) -> None:
    """``fully_shard`` each decoder layer of a transformers CausalLM (``model.model.layers``), then the model.
    ``experts``: each MoE layer's routed experts first, as units of their own that are never gathered
    (``parallel.experts``: each rank computes its own).

    Call before building the optimizer: FSDP2 replaces the parameters by DTensor shards. ``compute_dtype``: mixed
    precision (FSDP2's ``MixedPrecisionPolicy``): the shards stay in the model's dtype (the master weights AdamW
    steps), a gather casts them to ``compute_dtype``, and gradients are reduced in the master dtype. ``offload``:
    FSDP2's ``CPUOffloadPolicy`` — the shards live on the host (a gather copies them to the device first), so do
    their gradients (each reduction's result is copied there as it completes) and the optimizer's state and step."""
    policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        master = next(model.parameters()).dtype
        if compute_dtype == master:
            raise ValueError(f"mixed precision computes in {compute_dtype}, the model's own dtype: nothing to mix")
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=master)
    placement: Any = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    backbone: Any = model.model  # transformers' decoder (typed dynamically, as in the adapters)
    if experts and any(is_lora_layer(unit) for unit in expert_units(model)):
        raise ValueError(
            "expert parallelism with LoRA adapters on the routed experts is not supported (each rank holds whole "
            "experts, their adapters are cut otherwise): leave the experts out of model.lora.target_modules"
        )
    with host_placement(offload):
        for unit in expert_units(model) if experts else []:
            fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=placement)
        for layer in backbone.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=placement)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=placement)


def expert_units(model: nn.Module) -> list[Any]:
    """The routed experts of each MoE layer of a transformers CausalLM (``layer.mlp.experts``), in layer order:
    units of their own under expert parallelism (``shard_model(experts=True)``)."""
    backbone: Any = model.model  # transformers' decoder (typed dynamically, as in the adapters)
    return [layer.mlp.experts for layer in backbone.layers if hasattr(layer.mlp, "experts")]


def offloaded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with its shards on the host (``shard_model(offload=True)``)."""
    return is_sharded(model) and isinstance(offload_policy(model), CPUOffloadPolicy)


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a gather of a sharded ``model`` gives its weights in (None: its own, no mixed precision)."""
    return mixed_precision_policy(model).param_dtype


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def prefetch_window(cp: int) -> int:
    """How many gathers ``LayerGather`` starts ahead, and partial reductions it keeps in flight, over ``cp`` ranks:
    ``cp``. In the wavefront the ranks reach a layer up to cp - 1 layers apart, and a gather (or a reduction) waits
    for all of them; a smaller window would stall the first rank until the last catches up."""
    return cp


@dataclass
class WeightSharding:
    """How a step reaches a model's weights: ``weights`` (per-layer gathers inside the engine; None for a model
    that is not sharded) and the block the step runs in (``step``): the root unit gathered for it. ``replicated``:
    HSDP, the model copied over the dp ranks."""

    model: nn.Module
    weights: LayerGather | None = None
    replicas: int = 1
    replicated: bool = False

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The block of an optimizer step's forwards and backwards; on leaving it every gradient is in its shard,
        summed over every rank (HSDP: over the dp replicas too, once, at the end: their groups differ in shape, so
        their per-layer reductions cannot be collectives over all of them)."""
        with self.weights.gathered(None) if self.weights is not None else contextlib.nullcontext():
            yield
        if self.replicated:
            reduce_replicas(self.model)


class LayerGather:
    """The engine's ``LayerWeights`` over a model ``shard_model`` sharded, for ranks that compute in lockstep (the cp
    ranks of one group, dp = 1): a decoder layer's weights are whole only while the engine computes with it, and its
    gradient goes to the shards as soon as the layer's backward is done — no rank ever holds the whole model or its
    whole gradient. The root unit (embeddings, final norm, LM head) is gathered for a block (``gathered(None)``:
    the trainer's step).

    Two ways in: ``gathered(i)`` for a block that runs layer ``i``'s forward and backward (the sharded capture, the
    wavefront walk: layer by layer); ``run(i, fn, h)`` for a forward whose backward comes later (branch replays) or
    runs all layers at once (a chunk's recomputation): the weights are freed after the forward, gathered again when
    the first gradient reaches the layer's outputs, and reduced when the gradient of its input is computed (what
    FSDP2's own hooks do around a module's forward; the engine never calls one). A backward that leaves a layer
    unreduced (a gradient that reaches none of its inputs) has it reduced at its end.

    ``replicas``: how many ranks compute the same gradient in replicated work (cp); ``partial=True`` blocks hold
    each rank's share of a sum instead (the wavefront walk). ``experts``: expert parallelism (a layer's nested expert
    units are never gathered, each rank computes its own: ``bind`` hands them to the engine's layers).
    The gathers and reductions are collectives over the shard mesh: every rank must make the same calls in the same
    order, computing or not.

    In a wavefront the ranks reach a layer at different times, and a gather waits for all of them: ``announce``
    the order of the coming gathers and up to ``ahead`` of them (by default ``window``) are started ahead
    (asynchronously, refilled as each is taken), so that a rank finds the layer it reaches already whole; a
    schedule that paces its own gathers announces with ``ahead=0`` and starts each with ``start_next`` as it falls
    due (a sharded capture: each layer once per wave of runs, ``cp`` layers whole on a rank of a balanced one).
    ``partial`` reductions run asynchronously too, each waited for ``window`` releases later. ``settle`` ends such
    a stretch. The most layers whole at once is then ``ahead + 1`` beside the layers a block holds open."""

    def __init__(
        self,
        model: nn.Module,
        replicas: int,
        window: int | None = None,
        experts: ExpertRounds | None = None,
    ):
        self.model, self.replicas = model, replicas
        # expert parallelism (``parallel.experts.ExpertExchange``): bound to the engine's layers, the MoE calls'
        # rounds in sharded extends
        self.experts = experts
        self.host = offloaded(model)  # the shards' gradients live on the host
        self.window = prefetch_window(replicas) if window is None else window
        self.ahead = self.window  # gathers started ahead (``announce``)
        backbone: Any = model.model
        self.units: list[nn.Module] = list(backbone.layers)
        # FSDP2 keeps a unit's whole parameters as the same tensors from one gather to the next (their storage
        # freed between): the objects autograd saved in a forward and gradients accumulate into
        self._whole: dict[int | None, dict[str, nn.Parameter]] = {}
        self._gathered: set[int | None] = set()
        self._blocks: dict[int | None, int] = {}  # unit -> the ``gathered`` blocks it is open in (they nest)
        self._backward_pending: dict[int, int] = {}  # layer -> forwards whose backward has begun but not ended
        self._coming: collections.deque[int] = collections.deque()  # announced gathers not yet made, in order
        self._started: dict[int, Any] = {}  # layer -> the handle of its gather started ahead
        self._reducing: collections.deque[list[tuple[DTensor, DTensor]]] = collections.deque()  # partial, in flight
        # partial reductions since the last settle, by id of the shard: (shard, this rank gave a gradient, the shard
        # had one before)
        self._touched: dict[int, tuple[DTensor, bool, bool]] = {}
        self.most_gathered = 0  # the most layers ever whole at once, taken or started ahead (the root not counted)

    def announce(self, layers: Sequence[int], ahead: int | None = None) -> None:
        """The layers the next gathers will be, in order (the same on every rank; a layer may come again once it
        is released); starts the first ``ahead`` (by default ``window``)."""
        self.ahead = self.window if ahead is None else ahead
        self._coming.extend(layers)
        self._start_ahead()

    def start_next(self) -> None:
        """Start the next announced gather now, whatever ``ahead`` says (a schedule that paces its own gathers:
        ``announce(..., ahead=0)``, then this as each is due). A unit gathers once at a time: its layer must not be
        whole or in flight on this rank."""
        layer = self._coming.popleft()
        if layer in self._started or layer in self._gathered:
            raise RuntimeError(f"layer {layer}'s gather started while it is whole or in flight on this rank")
        unit: Any = self.units[layer]  # an FSDPModule (fully_shard changes the class at run time)
        self._started[layer] = unit.unshard(async_op=True)
        self._count_whole()

    def _count_whole(self) -> None:
        whole = len(self._started) + sum(1 for k in self._gathered if k is not None)
        self.most_gathered = max(self.most_gathered, whole)

    def settle(self) -> None:
        """Wait for the partial reductions in flight; a parameter no rank had a gradient for in them (and none
        before: an expert no token chose) keeps none, as in one process (one collective over the shard mesh)."""
        self._land_all()
        if not self._touched:
            return
        entries = list(self._touched.values())
        self._touched.clear()
        mine = torch.tensor([had for _, had, _ in entries], dtype=torch.int64)
        shard = entries[0][0]  # (every shard of the model is cut over the same mesh)
        summed = DTensor.from_local(mine, shard.device_mesh, _summed_over_shards(shard.placements))
        anyone = summed.full_tensor().tolist()
        for (shard, _, before), found in zip(entries, anyone, strict=True):
            if not found and not before:
                shard.grad = None

    @contextlib.contextmanager
    def gathered(self, layer: int | None, partial: bool = False, reduce: bool = True) -> Iterator[None]:
        """Layer ``layer``'s weights (None: the root unit's) whole for the block; on leaving the outermost block of the
        layer, the gradient accumulated summed into the shards (divided by ``replicas`` unless ``partial``) and the
        whole copy freed. ``reduce=False``: the gradient stays on the whole copy for a later ``reduce``. Blocks of
        one layer nest: an inner one changes nothing. A block left by an exception drops the layer's gradient instead
        of reducing it: a failing rank must not enter collectives its peers are not in (it raises at once; they stop
        when it exits, naming it)."""
        self._unshard(layer)
        self._blocks[layer] = self._blocks.get(layer, 0) + 1
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            self._blocks[layer] -= 1
            if not self._blocks[layer]:
                del self._blocks[layer]
                if failed:
                    self._drop(layer)
                elif reduce:
                    self._release(layer, partial)
                else:
                    self._free(layer)
                    self._start_ahead()

    def reduce(self, layer: int) -> None:
        """The gradient layer ``layer``'s whole copy accumulated in blocks left with ``reduce=False``, each rank's share
        of a sum (zeros where it has none), summed into the shards asynchronously as a ``partial`` block's is: a
        schedule whose ranks leave a layer's blocks in different orders reduces in one order of its own (exact mode's
        balanced wavefront walk). Such a schedule posts a reduction once every rank is done with what it sums, so
        the one before is waited for first: one in flight at a time."""
        self._land_all()
        self._reduce(layer, self._whole[layer], partial=True)
        self._start_ahead()

    def _drop(self, layer: int | None) -> None:
        """The whole copy freed and the gradient it accumulated dropped, with no collective."""
        self._free(layer)
        for param in self._whole[layer].values():
            param.grad = None

    @property
    def lockstep(self) -> bool:
        """Under expert parallelism every rank must make the same layer calls."""
        return self.experts is not None

    @property
    def rounds(self) -> ExpertRounds | None:
        """Under expert parallelism, the MoE calls of a sharded extend as rounds (``parallel.experts``)."""
        return self.experts

    def bind(self, layers: Sequence[Any]) -> None:
        """Under expert parallelism: each MoE layer's routed experts computed where they are held."""
        if self.experts is not None:
            self.experts.bind(layers)

    def root_parameters(self) -> list[nn.Parameter]:
        """The parameters outside the decoder layers, as registered now (whole while the root is gathered)."""
        return list(self._registered(None).values())

    def run(self, layer: int, fn: Callable[[Tensor], Any], h: Tensor) -> Any:
        """``fn(h)`` — layer ``layer``'s forward, returning its output and new state entries — with its weights
        whole; under autograd, its backward gathers them again and reduces the gradient when it is done."""
        if not torch.is_grad_enabled() or layer in self._blocks:  # (inside a block, the block reduces)
            with self.gathered(layer):
                return fn(h)
        self._unshard(layer)
        try:
            if h.requires_grad:
                h = _AfterBackward.apply(h, self, layer)
            out = fn(h)
        finally:
            self._free(layer)
        tensors = [t for t in (out if isinstance(out, tuple | list) else (out,)) if torch.is_tensor(t)]
        outputs = [t for t in tensors if t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: self._before_backward(layer), mode="any")
        return out

    # --- the unit's life --------------------------------------------------------------------------------------
    def _unit(self, layer: int | None) -> Any:
        return self.model if layer is None else self.units[layer]

    def _unshard(self, layer: int | None) -> None:
        if layer in self._gathered:
            return
        started = self._started.pop(layer, None) if layer is not None else None
        if started is None:
            if self._coming and layer == self._coming[0]:
                self._coming.popleft()
            self._unit(layer).unshard()  # (posted now, before any gather started after it: one order on every rank)
        self._gathered.add(layer)  # (a later turn of this layer in the order starts after its release)
        # the next gathers start as this one is taken (a rank that releases a layer only at its later run's cell
        # would otherwise start none until then)
        self._start_ahead()
        if started is not None:
            started.wait()
        self._whole.setdefault(layer, self._registered(layer))
        self._count_whole()

    def _start_ahead(self) -> None:
        """Start the gathers of the next announced layers, up to ``ahead`` of them in flight, in order: a layer whole
        or in flight here comes again only after its release (which starts it then)."""
        while self._coming and len(self._started) < self.ahead:
            if self._coming[0] in self._started or self._coming[0] in self._gathered:
                break
            self.start_next()

    def _free(self, layer: int | None) -> None:
        """The whole copy freed (its tensors keep any gradient for a later ``_release``)."""
        if layer in self._gathered:
            self._unit(layer).reshard()
            self._gathered.discard(layer)

    def _release(self, layer: int | None, partial: bool) -> None:
        self._free(layer)
        self._reduce(layer, self._whole[layer], partial)
        self._start_ahead()

    def _reduce(self, layer: int | None, whole: dict[str, nn.Parameter], partial: bool) -> None:
        """The gradient layer ``layer``'s whole copy accumulated, summed into its shards."""
        shards = self._registered(layer)
        if partial:
            self._reduce_partial(whole, shards)
        else:
            _reduce_into_shards(whole, shards, self.replicas, self.host)

    def _reduce_partial(self, whole: dict[str, nn.Parameter], shards: dict[str, Any]) -> None:
        """Each rank's share summed into the shards, asynchronously; a rank without a share gives zeros (it must
        meet the others' collective), and which ranks had one is settled later."""
        flight = []
        for name, shard in shards.items():
            if not isinstance(shard, DTensor) or not shard.requires_grad:  # (frozen: a LoRA policy's weights)
                continue
            param = whole[name]
            had = param.grad is not None
            earlier = self._touched.get(id(shard))
            self._touched[id(shard)] = (
                shard,
                had or (earlier is not None and earlier[1]),
                shard.grad is not None if earlier is None else earlier[2],
            )
            flight.append((shard, _reduce_scatter(taken_gradient(param, shard.dtype), shard, async_op=True)))
        self._in_flight(flight)

    def _in_flight(self, flight: Any) -> None:
        """One release's asynchronous reductions, waited for ``window`` releases later."""
        self._reducing.append(flight)
        while len(self._reducing) > self.window:
            self._land(self._reducing.popleft())

    def _land_all(self) -> None:
        while self._reducing:
            self._land(self._reducing.popleft())

    def _land(self, flight: Any) -> None:
        """Wait for one release's reductions and add them into their shards' gradients."""
        _settle(flight, self.host)

    def _registered(self, layer: int | None) -> dict[str, nn.Parameter]:
        """The unit's own parameters as registered now (whole while gathered, else its shards), by name: not those
        of the units nested in it (the decoder layers in the root; a layer's experts under expert parallelism,
        never gathered)."""
        unit = self._unit(layer)
        nested = {
            id(p) for inner in unit.modules() if inner is not unit and is_sharded(inner) for p in inner.parameters()
        }
        return {name: p for name, p in unit.named_parameters() if id(p) not in nested}

    # --- autograd's side --------------------------------------------------------------------------------------
    def _before_backward(self, layer: int) -> None:
        if not self._backward_pending:  # the first layer this backward reaches: reduce what it leaves, at its end
            Variable._execution_engine.queue_callback(self._after_whole_backward)
        self._backward_pending[layer] = self._backward_pending.get(layer, 0) + 1
        self._unshard(layer)

    def _after_layer_backward(self, layer: int) -> None:
        pending = self._backward_pending.get(layer, 0) - 1
        if pending > 0:  # another forward of the layer (another member's graph) is still on its way back
            self._backward_pending[layer] = pending
            return
        self._backward_pending.pop(layer, None)
        self._release(layer, partial=False)

    def _after_whole_backward(self) -> None:
        for layer in sorted(self._backward_pending, reverse=True):
            self._release(layer, partial=False)
        self._backward_pending.clear()


def whole_parts(model: nn.Module, keep: bool = True) -> Iterator[dict[str, Tensor]]:
    """``model``'s parameters and persistent buffers whole, on the host, one part at a time: the root unit's
    (embeddings, final norm, LM head), then each decoder layer's — what a served policy loads, assembled without
    the whole model on any device. A sharded parameter is gathered in its master dtype (``DTensor.full_tensor``: a
    collective over the shard mesh, so every rank of the job iterates every part, in order) and freed from the
    device before the next; tied parameters appear once (the first name). Unsharded, the model's own tensors.
    ``keep=False``: a rank that only takes part in the gathers (each part then empty: nothing copied to the host)."""
    layers = len(model.model.layers)  # type: ignore[union-attr,arg-type]  # a transformers CausalLM
    parts: list[dict[str, Tensor]] = [{} for _ in range(layers + 1)]
    state: dict[str, Tensor] = dict(model.named_parameters())
    persistent = {name for name in model.state_dict() if name not in state}
    state |= {name: b for name, b in model.named_buffers() if name in persistent}
    for name, tensor in state.items():
        parts[_part_of(name)][name] = tensor
    for part in parts:
        yield {name: _whole(tensor) for name, tensor in part.items()} if keep else _gathered_only(part)


def _gathered_only(part: dict[str, Tensor]) -> dict[str, Tensor]:
    """Take part in gathering ``part``'s sharded tensors, keeping nothing."""
    for tensor in part.values():
        if isinstance(tensor, DTensor):
            tensor.full_tensor()
    return {}


def _part_of(name: str) -> int:
    """0 for the root unit's tensors, 1 + i for decoder layer i's (``model.layers.{i}.``)."""
    prefix = "model.layers."
    return 1 + int(name[len(prefix) :].split(".", 1)[0]) if name.startswith(prefix) else 0


def _whole(tensor: Tensor) -> Tensor:
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu", copy=True)


class _AfterBackward(torch.autograd.Function):
    """Identity on a layer's input; its backward runs once the layer's own backward has produced the input's
    gradient: then the layer's gradient is reduced into its shards."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, gather: LayerGather, layer: int) -> Tensor:
        ctx.gather, ctx.layer = gather, layer
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.gather._after_layer_backward(ctx.layer)
        return grad, None, None


def _settle(flight: list[tuple[DTensor, DTensor]], host: bool) -> None:
    """Wait for the reductions of one release and add them into their shards' gradients."""
    for shard, reduced in flight:
        add_into_shard(shard, reduced.to_local(), host)


def _reduce_into_shards(whole: dict[str, nn.Parameter], shards: dict[str, Any], replicas: int, host: bool) -> None:
    """Each whole parameter's gradient summed over the shard mesh into its shard's gradient (divided by
    ``replicas``), the whole one dropped; in the shard's dtype (mixed precision: the master's, not the compute
    dtype); on the host where the shards are offloaded. Every rank must have a gradient for the same parameters."""
    for name, shard in shards.items():
        if whole[name].grad is None or not isinstance(shard, DTensor):
            continue
        grad = taken_gradient(whole[name], shard.dtype, replicas)
        add_into_shard(shard, _reduce_scatter(grad, shard).to_local(), host)


def taken_gradient(param: nn.Parameter, dtype: torch.dtype, replicas: int = 1) -> Tensor:
    """``param``'s gradient taken from it for a reduction (the parameter keeps none): in ``dtype`` (the shard's: the
    master's under mixed precision), zeros where it has none (a rank must meet the others' collective), divided by
    ``replicas`` (the ranks holding the same one)."""
    grad = param.grad.to(dtype) if param.grad is not None else torch.zeros_like(param, dtype=dtype)
    param.grad = None  # (``grad`` may be it: divided in place)
    if replicas > 1:
        grad.div_(replicas)
    return grad


def add_into_shard(shard: DTensor, local: Tensor, host: bool) -> None:
    """This rank's part of a reduced gradient added into ``shard``'s gradient; with ``host`` (an offloaded shard)
    copied to the host first, as soon as it is complete, so that the device keeps no gradient shard."""
    if isinstance(local, AsyncCollectiveTensor):  # (a reduction started asynchronously: waited for here)
        local = local.wait()
    if host:
        with host_placement():
            copy = torch.empty_like(local, device="cpu")
            copy.copy_(local)
        local = copy
    done = DTensor.from_local(local, shard.device_mesh, shard.placements, shape=shard.shape, stride=shard.stride())
    with host_placement(host):
        shard.grad = done if shard.grad is None else shard.grad + done


def _reduce_scatter(grad: torch.Tensor, shard: DTensor, async_op: bool = False) -> DTensor:
    """This rank's full-size gradient, summed over the ranks the shard is cut over and cut to the shard's placement
    (started only, with ``async_op``: the collective is waited for where the result is read). Over a replicated
    dimension (HSDP's dp) nothing is summed: each replica keeps its own sum until ``reduce_replicas``."""
    partial = DTensor.from_local(grad, shard.device_mesh, _summed_over_shards(shard.placements))
    return partial.redistribute(shard.device_mesh, shard.placements, async_op=async_op)


def _summed_over_shards(placements: Sequence[Placement]) -> list[Placement]:
    """``placements`` with each sharded dimension a pending sum (``Partial``), replicated ones kept."""
    return [Partial("sum") if p.is_shard() else p for p in placements]


def reduce_replicas(model: nn.Module) -> None:
    """HSDP: every gradient shard summed over the mesh dimensions the model is replicated over (dp), in place, in
    parameter order, where it lives (an offloaded shard's on the host: the process groups take host tensors through
    their CPU backend, ``parallel.launch``'s ``cpu:gloo,cuda:nccl``). Every rank must have a gradient for the same
    parameters (give zeros where a rank has none)."""
    handles = []
    for param in model.parameters():
        grad = param.grad
        if not isinstance(grad, DTensor):  # (a sharded parameter's gradient is one)
            continue
        for dim, placement in enumerate(grad.placements):
            if placement.is_replicate():
                group = grad.device_mesh.get_group(dim)
                handles.append(dist.all_reduce(grad.to_local(), group=group, async_op=True))
    for handle in handles:
        handle.wait()
