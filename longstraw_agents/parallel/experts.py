"""Expert parallelism for a mixture of experts (the ``glm_moe_dsa`` family): each cp rank holds its own experts
whole, computes them, and never gathers the others'.

- **Sharding** (``expert_units``, which ``fsdp.shard_model(experts=True)`` shards first): each MoE layer's routed
  experts (``mlp.experts``: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, stacked by expert) are an
  FSDP2 unit of their own, nested in their decoder layer's, cut along the expert dimension over the shard mesh —
  the cp ranks (dp = 1, or HSDP's shard dimension: replicated over dp) — so rank r holds experts
  ``r·E/cp .. (r+1)·E/cp - 1`` whole, with their master weights, gradients and optimizer state. ``LayerGather``
  gathers a layer without its nested units: what a gather moves and holds shrinks by the experts' share of the
  layer (most of a GLM-5.2 layer).
- **Compute, replicated** (``ExpertShard``, each MoE's ``routed``): an extend computed replicated (branch replays,
  scoring, turns, exact mode's walk; every extend with ``EngineConfig.sharded_extends=False``) has every cp rank
  hold the same tokens and routing and make the same MoE calls in the same order. Each rank computes its own
  experts' share of each token's sum (``MoE.experts_of``) and one all-reduce over the cp ranks adds the shares. In
  backward the shares' inputs (the tokens and their routing weights) get gradients summed over the ranks (each
  rank's experts give part of them); an expert's weights get theirs on the rank that holds it, complete — no
  reduction, no division by the replicas replicated work is divided by. A rank whose experts no token chose gives
  them zeros in that call's backward, as one process's stacked weights get a gradient whenever any expert of the
  layer is chosen.
- **Compute, sharded** (``ExpertExchange``: ``parallel.expert_dispatch``): a sharded extend (a capture: each rank
  its own chunks, no gradient) makes each MoE call a round of all-to-alls — every token goes to the ranks holding
  its chosen experts and their outputs come back (``ExpertExchange`` says how) — the engine making as many rounds
  on every rank at each wavefront step (``ShardedCapture``). A round's all-to-alls take their split sizes on the
  host: the one host sync of a MoE call here (a replicated call, like one process's, has none where its grouped
  matmuls have none: ``models.grouped``).
- **Not built**: dispatch under autograd (exact mode's wavefront walk: under expert parallelism exact mode walks
  replicated); expert parallelism over dp ranks without HSDP (their groups differ in shape, so their MoE calls do
  not line up: ``parallel.lanes`` serves gathers, not experts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from longstraw_agents.models.grouped import Routing
from longstraw_agents.models.mla import MoE
from longstraw_agents.parallel.fsdp import add_into_shard, compute_dtype, expert_units, is_sharded, offloaded


def experts_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s experts are units of their own (``fsdp.shard_model(experts=True)``): expert parallelism."""
    return any(is_sharded(unit) for unit in expert_units(model))


def check_experts_divide(model: nn.Module, ranks: int) -> None:
    """Expert parallelism over ``ranks`` needs whole experts on every rank: the expert count a multiple of it."""
    units = expert_units(model)
    if not units:
        raise ValueError("expert parallelism needs a mixture of experts; the model has no MoE layer (mlp.experts)")
    for unit in units:
        experts = int(unit.gate_up_proj.shape[0])
        if experts % ranks:
            raise ValueError(
                f"expert parallelism over {ranks} cp ranks needs a multiple of {ranks} routed experts per layer, "
                f"the model has {experts}"
            )


class ExpertShard:
    """A MoE's ``routed`` under expert parallelism over ``group`` (the cp ranks): this rank's experts (``per_rank``
    of them from ``first``) computed on every token, their shares added over the ranks (see the module's
    docstring); their gradient goes straight into the rank's shards (the host's where they are offloaded).
    ``over`` reads them from the sharded experts; ``planned`` makes one for the memory planner, whose model is
    whole on the meta device: the experts a rank holds sliced from it, nothing added (no process group), their
    gradient computed and dropped (no shards: the planner counts their cast and accumulation from the
    parameters)."""

    def __init__(
        self,
        moe: MoE,
        group: dist.ProcessGroup | None,
        compute_dtype: torch.dtype | None,
        first: int,
        per_rank: int,
        offloaded: bool = False,
        layer: int = 0,
        exchange: ExpertExchange | None = None,
    ):
        self.moe, self.group, self.compute_dtype = moe, group, compute_dtype
        self.first, self.per_rank = first, per_rank
        self.offloaded = offloaded  # the shards on the host: each use copies them in (also where host is device)
        self.layer, self.exchange = layer, exchange  # (the sharded extends' rounds: ``ExpertExchange``)

    @classmethod
    def over(cls, moe: MoE, layer: int, exchange: ExpertExchange) -> ExpertShard:
        gate_up = moe.experts.gate_up_proj
        if not isinstance(gate_up, DTensor):
            raise ValueError("expert parallelism needs the experts sharded (fsdp.shard_model(experts=True))")
        dim = _expert_dim(gate_up)
        per_rank = moe.num_experts // gate_up.device_mesh.size(dim)
        first = gate_up.device_mesh.get_local_rank(dim) * per_rank
        group, dtype, host = exchange.group, exchange.compute_dtype, exchange.offloaded
        return cls(moe, group, dtype, first, per_rank, host, layer, exchange)

    @classmethod
    def planned(cls, moe: MoE, ranks: int, layer: int = 0, exchange: ExpertExchange | None = None) -> ExpertShard:
        """The first of ``ranks`` cp ranks' share (every rank's is alike), for the planner's meta model (its
        sharded extends' rounds: a ``PlannedExchange``)."""
        return cls(moe, None, None, 0, moe.num_experts // ranks, layer=layer, exchange=exchange)

    @property
    def params(self) -> tuple[Tensor, Tensor]:
        return self.moe.experts.gate_up_proj, self.moe.experts.down_proj

    @property
    def trains(self) -> bool:
        """Whether the rank's experts take a gradient (a policy's; not a frozen reference's)."""
        return any(p.requires_grad for p in self.params)

    def __call__(self, x: Tensor, top_idx: Tensor, weights: Tensor) -> Tensor:
        if self.exchange is not None and self.exchange.active:  # (a sharded extend: each rank its own tokens)
            return self.exchange.call(self.layer, x, top_idx, weights)
        if torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad or self.trains):
            if not (x.requires_grad or weights.requires_grad):  # (so that the node's backward runs: the experts')
                x = x.detach().requires_grad_()
            return _SharedExperts.apply(self, top_idx, x, weights)
        return self.summed(self.share(top_idx, x, weights, *self.local_weights(x)))

    def share(self, top_idx: Tensor, x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        """This rank's experts' part of each token's sum."""
        return self.moe.experts_of(x, top_idx, weights, gate_up, down, self.first)

    def each(self, x: Tensor, experts: Tensor, weights: tuple[Tensor, Tensor]) -> Tensor:
        """Row k of ``x`` through expert ``experts[k]`` (one of this rank's, whose ``local_weights`` are
        ``weights``), unweighted."""
        ones = torch.ones(len(experts), 1, dtype=x.dtype, device=x.device)
        return self.share(experts[:, None], x, ones, *weights)

    def summed(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the ranks, in place."""
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def local_weights(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's experts' stacked weights (``gate_up_proj``, ``down_proj``) on ``like``'s device, in the
        compute dtype (the master shards may be on the host, in fp32), without a graph."""
        gate_up, down = (self._local(p, like) for p in self.params)
        if gate_up.shape[0] != self.per_rank:
            raise RuntimeError(f"this rank holds {gate_up.shape[0]} experts, expected {self.per_rank}")
        return gate_up, down

    def add_gradients(self, grads: list[Tensor | None]) -> None:
        """The rank's experts' gradient (``gate_up_proj``'s, ``down_proj``'s; None: none computed) added into
        their shards' — zeros where none, as one process's stacked weights get a gradient whenever any
        expert of the layer is chosen, and the shards' gradients must agree in which exist. Taken from ``grads``
        one at a time, each freed once it is in its shard's dtype."""
        for k, param in enumerate(self.params):
            assert isinstance(param, DTensor)  # (``trains``: sharded)
            grad, grads[k] = grads[k], None
            local = param.to_local()
            if grad is None:
                if param.grad is not None:
                    continue
                grad = torch.zeros_like(local)
            grad = grad.to(local.dtype)  # (the compute dtype's freed here)
            add_into_shard(param, grad, self.offloaded)

    def _local(self, param: Tensor, like: Tensor) -> Tensor:
        if isinstance(param, DTensor):
            local = param.to_local()
        else:  # (the planner's whole model: the slice a rank holds)
            local = param[self.first : self.first + self.per_rank]
        # offloaded: copied in first, then cast on the device (a blocking copy that casts would cast on the host)
        moved = local.detach().to(device=like.device, copy=self.offloaded, non_blocking=self.offloaded)
        return moved.to(dtype=self.compute_dtype or local.dtype)


class ExpertExchange:
    """The MoE layers' ``ExpertShard``s of one model over ``group`` (the cp ranks), and the engine's ``ExpertRounds``
    for its sharded extends (``engine.ShardedCapture``), where each rank computes its own tokens.

    Replicated work (every rank the same tokens) sums each rank's experts' share with one all-reduce per MoE call.
    In a sharded extend (no gradient) each MoE call is a *round* of all-to-alls instead, as DeepSpeed-MoE and
    torchtitan dispatch tokens: the rank sends each token, once per chosen expert, to the rank holding that expert
    (with a header naming its layer: peers may be at other layers of the wavefront), computes what it received with
    its own experts of the sender's layer (cast or copied in once per layer and round), sends the outputs back, and
    adds each token's, weighted by the router, one after another in expert order (one process's order, on any
    device). Every rank makes the same number of rounds (``idle`` where it has fewer calls: it still serves the
    others'). A round holds what the peers send: about what the rank sent where routing is even (what the planner
    assumes, ``PlannedExchange``), more on a rank whose experts draw more tokens."""

    def __init__(self, group: dist.ProcessGroup | None, compute_dtype: torch.dtype | None, offloaded: bool):
        self.group = group  # (None: the planner's, which sends nothing)
        self.compute_dtype, self.offloaded = compute_dtype, offloaded
        self.shards: dict[int, ExpertShard] = {}  # layer -> its MoE's routed experts here
        self.active = False
        self.calls = 0  # rounds with tokens of this rank's (its MoE calls in sharded extends)

    @classmethod
    def over(cls, model: nn.Module, group: dist.ProcessGroup) -> ExpertExchange:
        """Over ``model``'s sharded experts: computing in its compute dtype from its shards (offloaded or not)."""
        return cls(group, compute_dtype(model), offloaded(model))

    def bind(self, layers: Sequence[Any]) -> None:
        """What ``LayerGather.bind`` does under expert parallelism: an ``ExpertShard`` in place of each MoE layer's
        ``routed`` (an engine's ``adapter.layers``)."""
        for i, layer in enumerate(layers):
            if isinstance(layer.mlp, MoE):
                layer.mlp.routed = self.shards[i] = self._shard(layer.mlp, i)

    def _shard(self, moe: MoE, layer: int) -> ExpertShard:
        return ExpertShard.over(moe, layer, self)

    @property
    def routed(self) -> frozenset[int]:
        """The layers whose MoE calls are rounds."""
        return frozenset(self.shards)

    @contextlib.contextmanager
    def dispatching(self) -> Iterator[None]:
        """MoE calls as rounds for the block (a sharded extend; no gradient)."""
        if torch.is_grad_enabled():
            raise RuntimeError("expert rounds dispatch tokens without a gradient (a sharded extend's)")
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def call(self, layer: int, x: Tensor, top_idx: Tensor, weights: Tensor) -> Tensor:
        """Layer ``layer``'s routed experts' sum for this rank's tokens ``x``: a round."""
        self.calls += 1
        # the rows grouped by expert, so by the rank holding it; each token's outputs added one after another in
        # expert order, as one process adds them (``MoE.experts_of``), on any device
        routing = Routing.of(top_idx, 0, self.shards[layer].moe.num_experts, others=False)
        answers = self._round(layer, routing.rows(x), routing.keys)
        return routing.combine(answers, weights, x.dtype)

    def idle(self, like: Tensor) -> None:
        """A round without tokens of this rank's (``like``: hidden states, for their width and device): it serves
        the others'."""
        rows = like.new_empty(0, like.shape[-1], dtype=self.compute_dtype or like.dtype)
        self._round(-1, rows, torch.empty(0, dtype=torch.int64, device=like.device))

    def _round(self, layer: int, rows: Tensor, experts: Tensor) -> Tensor:
        """Send each of ``rows`` to the rank holding its expert (``experts``, ascending), serve what the peers sent,
        and return the answers, row for row. The all-to-alls take their split sizes on the host: a round syncs with
        the device (the one host sync of a MoE call, here only: a replicated call and one process's have none)."""
        size = dist.get_world_size(self.group)
        per_rank = next(iter(self.shards.values())).per_rank
        sent = torch.bincount(torch.div(experts, per_rank, rounding_mode="floor"), minlength=size)
        header = torch.stack([torch.full_like(sent, layer), sent], dim=1)
        heard = torch.empty_like(header)
        dist.all_to_all_single(heard, header, group=self.group)
        layers, counts = heard[:, 0].tolist(), heard[:, 1].tolist()
        out_splits = sent.tolist()
        taken = rows.new_empty(sum(counts), rows.shape[1])
        dist.all_to_all_single(taken, rows.contiguous(), counts, out_splits, group=self.group)
        taken_experts = experts.new_empty(sum(counts))
        dist.all_to_all_single(taken_experts, experts.contiguous(), counts, out_splits, group=self.group)
        served = torch.empty_like(taken)
        parts: dict[int, list[slice]] = {}  # a layer's rows from each peer at it: its experts cast (copied) once
        at = 0
        for peer_layer, count in zip(layers, counts, strict=True):
            if count:
                parts.setdefault(peer_layer, []).append(slice(at, at + count))
                at += count
        for peer_layer, slices in parts.items():
            shard = self.shards[peer_layer]
            weights = shard.local_weights(taken)
            for part in slices:
                served[part] = shard.each(taken[part], taken_experts[part], weights).to(served.dtype)
            del weights
        answers = torch.empty_like(rows)
        dist.all_to_all_single(answers, served, out_splits, counts, group=self.group)
        return answers


class PlannedExchange(ExpertExchange):
    """The memory planner's ``ExpertExchange`` over its whole model on the meta device, as the first of ``ranks`` cp
    ranks computes a round (every rank's alike): its tokens once per chosen expert, as many rows served as it sent
    (a balanced routing) with its experts (whichever: the grouped kernel holds the same for any); no process group,
    nothing sent."""

    def __init__(self, ranks: int):
        super().__init__(None, None, False)
        self.ranks = ranks

    def _shard(self, moe: MoE, layer: int) -> ExpertShard:
        return ExpertShard.planned(moe, self.ranks, layer, self)

    def _round(self, layer: int, rows: Tensor, experts: Tensor) -> Tensor:
        shard = self.shards[layer]
        taken = torch.empty_like(rows)  # (as many served as sent)
        served = shard.each(taken, experts.new_empty(len(taken)), shard.local_weights(taken))
        answers = torch.empty_like(served)  # (received beside what was taken and served, as a round holds them)
        return answers


def _expert_dim(param: DTensor) -> int:
    """The mesh dimension ``param`` is cut over (FSDP2's ``Shard(0)``: the expert dimension)."""
    dims = [d for d, placement in enumerate(param.placements) if placement.is_shard()]
    if len(dims) != 1:
        raise ValueError(f"experts sharded over one mesh dimension expected, got placements {param.placements}")
    return dims[0]


def _gradients(out: Tensor, leaves: list[Tensor], grad: Tensor) -> list[Tensor | None]:
    """``out``'s gradient (``grad`` its own) in each of ``leaves`` that requires one, None for the others. Nothing
    else keeps the leaves or the gradients once it returns (the caller frees the leaves, then each gradient)."""
    if not out.requires_grad:  # (none of its inputs takes a gradient)
        return [None] * len(leaves)
    inputs = [leaf for leaf in leaves if leaf.requires_grad]
    computed = iter(torch.autograd.grad(out, inputs, grad, allow_unused=True))
    return [next(computed) if leaf.requires_grad else None for leaf in leaves]


class _SharedExperts(torch.autograd.Function):
    """The ranks' shares of the routed experts' sum, added (one all-reduce). Its backward runs on every rank, in
    the same place of every rank's graph, whichever experts each rank's tokens chose (autograd runs only the nodes
    a gradient reaches, and a rank's own experts' graph differs from its peers'). Nothing of the share's graph is
    kept between forward and backward: the backward casts the rank's experts again and recomputes the share under
    autograd (as FSDP2 gathers a layer again for its backward; kept, every MoE call of a branch would hold its own
    compute copy of the rank's experts until the backward). The gradients of the tokens and their routing weights —
    each rank's experts gave part of them — are summed over the ranks, in that order; every rank computes the same
    thing after the sum, so the share's gradient is the sum's. The rank's experts' gradient goes into their shards
    (``ExpertShard.add_gradients``), whole: no reduction."""

    @staticmethod
    def forward(ctx: Any, shard: ExpertShard, top_idx: Tensor, x: Tensor, weights: Tensor) -> Tensor:
        ctx.shard = shard
        ctx.save_for_backward(top_idx, x, weights)
        return shard.summed(shard.share(top_idx, x, weights, *shard.local_weights(x)))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        shard: ExpertShard = ctx.shard
        top_idx, x, weights = ctx.saved_tensors
        wanted = [*ctx.needs_input_grad[2:4], shard.trains, shard.trains]
        with torch.enable_grad():
            tensors = (x, weights, *shard.local_weights(x))
            leaves = [t.detach().requires_grad_(w) for t, w in zip(tensors, wanted, strict=True)]
            share = shard.share(top_idx, *leaves)
        found = _gradients(share, leaves, grad)
        del share, leaves, tensors  # (the experts' compute copies: freed before their gradient's master copy)
        if shard.trains and shard.group is not None:  # (the planner's: no shards)
            experts = found[2:]
            del found[2:]
            shard.add_gradients(experts)
        grads: list[Tensor | None] = []
        for k, (like, g) in enumerate(zip((x, weights), found[:2], strict=True)):
            if not ctx.needs_input_grad[2 + k]:
                grads.append(None)
                continue
            # (every rank's experts gave part of the tokens' and routing weights' gradient)
            grads.append(shard.summed(torch.zeros_like(like) if g is None else g.contiguous()))
        return (None, None, *grads)
