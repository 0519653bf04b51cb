"""One simulated step on the meta device (``probe``) on models cut to two and three layer periods, extrapolated to
the full model (``extrapolated``): the graphs a step holds beyond what grows with the context (its peak less the exact
terms), a capture's working set, and the parameters' counts. The probes run the real engine and trainer under
``MemoryTracker`` (``CachedMemoryTracker``: the same bytes in about half the time).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from longstraw_agents.engine import Engine
from longstraw_agents.logprobs import DEFAULT_TILE_ELEMENTS
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models.lora import lora_layers
from longstraw_agents.parallel.experts import PlannedExchange
from longstraw_agents.plan.configs import layer_period, meta_model, routed_experts, with_layers
from longstraw_agents.plan.growing import exact_terms
from longstraw_agents.plan.memory_plan import GIB
from longstraw_agents.plan.meta_cache import CachedMemoryTracker, MetaLayouts
from longstraw_agents.plan.request import PlanRequest, element_size
from longstraw_agents.segmenter import Member
from longstraw_agents.trainer.group import make_group
from longstraw_agents.trainer.loss import LossConfig
from longstraw_agents.trainer.modes import MODES

# The probes' meta ops answered from the layouts of their first answers (``meta_cache``: the same bytes in about half
# the time), kept for the process: every plan's probes repeat the same ops. False: torch computes each (tests, bench).
CACHE_META_OPS = True
PROBE_LAYOUTS = MetaLayouts()


def probe_tracker() -> MemoryTracker:
    """The memory tracker a probe runs under: answering its meta ops from ``PROBE_LAYOUTS`` (``CACHE_META_OPS``)."""
    return CachedMemoryTracker(PROBE_LAYOUTS) if CACHE_META_OPS else MemoryTracker()


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
    with probe_tracker() as tracker:
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
        with probe_tracker() as tracker:
            state = engine.capture(prompt.tolist())
            kept = tracker.current_bytes
    del state
    return tracker.peak_bytes - kept


@dataclass(frozen=True)
class Probe:
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


def probe(config: PretrainedConfig, request: PlanRequest, group: int) -> Probe:
    """Simulate a step of ``group`` members on ``config`` over two chunks of context, and a capture of them."""
    model = meta_model(config, request.dtype, request.lora)
    routed = [routed_experts(layer) for layer in model.model.layers]
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
        return Probe(graphs, parameters, max(in_layers), root, layers, capture, tuple(routed), tuple(in_layers))
    return Probe(
        graphs, parameters, max(in_layers), root, layers, capture, tuple(routed), tuple(in_layers),
        trained, trained - sum(trained_in), max(trained_in), head_trains,
    )  # fmt: skip


def _probe_prompt(request: PlanRequest) -> int:
    """The prompt a probe simulates: two chunks of context, then the token that starts every branch."""
    return 2 * request.engine.chunk_size + 1


def _graphs(model: Any, request: PlanRequest, group: int) -> int:
    """A step's peak on the meta ``model`` less the terms the plan counts from the engine's own accounting."""
    prompt_len = _probe_prompt(request)
    peak = step_peak(model, request, prompt_len, group)
    exact = exact_terms(model.config, replace(request, history=0, turns=1), prompt_len - 1)  # (the probe's group)
    return peak - (exact.state + exact.dstate + exact.checkpoints + exact.reference_state)


def extrapolated(config: PretrainedConfig, request: PlanRequest) -> tuple[Probe, str]:
    """The full model's graph bytes and parameters from models cut to two and three layer periods (all layers when
    the model has no more), simulated with two members; the group's own growth (G members instead of two) is
    measured on the smallest cut and added. Not from one period: a step's peak over a single period can fall at
    another moment than over more (a tiny Llama's detached step: 0.19 MiB at 1 layer, 0.43 at 2, then 0.06 a
    layer), so a line through one and two periods overshoots."""
    head, period = layer_period(config)
    n1, n2, full = head + 2 * period, head + 3 * period, config.num_hidden_layers
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
    probed = Probe(
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


def logits_bytes(config: PretrainedConfig, request: PlanRequest) -> int:
    """What the LM head's log-probs hold at once (part of the measured graphs): three logit tiles, and the head's
    weight gradient in fp32 and in the model's dtype before it joins the sharded gradients."""
    head = config.vocab_size * config.hidden_size
    return 3 * DEFAULT_TILE_ELEMENTS * 4 + head * (4 + element_size(request.dtype))
