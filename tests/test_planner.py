"""The memory planner (``plan``) against measurement: on tiny models of every family, the planned peak of a GRPO
step (state, its gradient, checkpoints, graphs — simulated on the meta device on models cut to one and two layer
periods, then extrapolated) is within 10 % of the peak the memory tracker measures running the real step on CPU."""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pydantic
import pytest
import torch

import longstraw_agents.plan as planning
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.engine.schedule import (
    Run,
    SegmentRecompute,
    WalkHolds,
    WaveGather,
    WaveReduction,
    capture_gathers,
    capture_layers_whole,
    cut_runs,
    runs_of,
    shards_extend,
    walk_cells,
    walk_holds,
    walk_inputs_held,
    walk_schedule,
    wavefront_cells,
    waves,
)
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.plan import (
    MODEL_NAMES,
    PLAN_ENGINE,
    PlanRequest,
    layer_inputs_bytes,
    layer_period,
    load_config,
    longest_context,
    model_problem,
    parameter_phases,
    plan_memory,
    with_layers,
)
from longstraw_agents.plan.memory_plan import _margin
from longstraw_agents.plan.planner import _Measured, _phase_categories, _plan
from longstraw_agents.plan.probes import Probe, extrapolated, probe
from longstraw_agents.trainer import grpo_backward

# more layers than the presets' defaults, so that the plan extrapolates from cut models
LAYERS = {"llama": 4, "qwen3_5": 12, "glm_moe_dsa": 7}
STATIC = (
    "weights",
    "gathered weights",
    "gradients",
    "gathered gradients",
    "optimizer state",
    "reference weights",
)
CHUNK, COMPLETION = 64, 16


@pytest.fixture(autouse=True)
def tiny_models(monkeypatch: pytest.MonkeyPatch) -> None:
    for family, layers in LAYERS.items():
        monkeypatch.setitem(
            planning.NAMED_MODELS, f"test-{family}", lambda f=family, n=layers: TINY_PRESETS[f](layers=n)
        )


def measured_peak(family: str, mode: str, group: int, context: int) -> int:
    config = TINY_PRESETS[family](layers=LAYERS[family])
    model = build_model(config, dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # as the planner: parameter gradients are planned, not measured
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, context)
    completions = [rng.integers(0, config.vocab_size, COMPLETION) for _ in range(group)]
    rewards = [float(k % 2) for k in range(group)]
    engine = Engine(model, EngineConfig(chunk_size=CHUNK))
    peak = grpo_backward(engine, prompt, completions, rewards, mode, track_memory=True).peak_bytes
    assert peak is not None
    return peak


@pytest.mark.parametrize(
    ("family", "mode", "group", "context"),
    [
        ("llama", "exact", 2, 512),
        ("llama", "detached", 8, 1024),
        ("qwen3_5", "exact", 4, 512),
        ("qwen3_5", "detached", 2, 1024),
        ("glm_moe_dsa", "exact", 2, 512),
        ("glm_moe_dsa", "detached", 4, 320),
    ],
)
def test_planned_peak_is_within_ten_percent_of_the_measured_one(family, mode, group, context) -> None:
    request = PlanRequest(
        model=f"test-{family}", context=context, group=group, completion=COMPLETION, gpus=1, mode=mode,
        dtype=torch.float32, optimizer="none", engine=EngineConfig(chunk_size=CHUNK),
    )  # fmt: skip
    plan = plan_memory(request)
    planned = sum(v for k, v in plan.categories.items() if k not in STATIC)
    measured = measured_peak(family, mode, group, context)
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)
    assert "extrapolated" in plan.notes[0] or "all" in plan.notes[0]


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_the_graph_is_extrapolated_from_the_second_and_third_period(mode: str) -> None:
    """A step's peak over one period can fall at another moment than over more (a tiny Llama's detached step:
    0.19 MiB at 1 layer, 0.43 at 2, then 0.06 a layer), so the planner extrapolates from 2 and 3 periods: at 8
    layers the line meets the graph of all 8 simulated (one through 1 and 2 layers gave 2.3x it)."""
    config = TINY_PRESETS["llama"](layers=8, hidden=64)
    request = PlanRequest(
        model=config, context=2048, group=2, completion=8, gpus=1, mode=mode, dtype=torch.float32,
        optimizer="adamw", engine=EngineConfig(chunk_size=128),
    )  # fmt: skip
    probed, how = extrapolated(config, request)
    assert "simulated 2 and 3 of 8 layers" in how
    assert probed.graphs == pytest.approx(probe(config, request, 2).graphs, rel=0.02)


def test_layer_periods_and_cut_configs() -> None:
    hybrid = TINY_PRESETS["qwen3_5"](layers=12)
    assert layer_period(hybrid) == (0, 4)
    glm = TINY_PRESETS["glm_moe_dsa"](layers=7)
    assert layer_period(glm) == (1, 2)  # one dense layer, then full / shared indexers alternating
    cut = with_layers(glm, 3)
    assert cut.num_hidden_layers == 3 and cut.indexer_types == glm.indexer_types[:3]


def test_static_terms_shard_over_every_gpu_and_the_context_over_cp() -> None:
    base = PlanRequest(
        model="test-llama",
        context=4096,
        group=2,
        completion=8,
        engine=PLAN_ENGINE.updated(chunk_size=CHUNK),
        dtype=torch.float32,
    )
    one = plan_memory(base.__class__(**{**base.__dict__, "gpus": 1}))
    four = plan_memory(base.__class__(**{**base.__dict__, "gpus": 4}))
    assert four.categories["captured state"] * 4 == pytest.approx(one.categories["captured state"], rel=0.01)
    assert four.categories["optimizer state"] * 4 == pytest.approx(one.categories["optimizer state"], rel=0.01)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"gpus": 0}, "gpus"),
        ({"gpus": -2}, "gpus"),
        ({"context": 0}, "context"),
        ({"beta": float("nan")}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"dp": 0}, "dp"),
        ({"gpu_mem_bytes": 0}, "gpu_mem_bytes"),
        ({"group": "8"}, "group"),  # a number must be a number, as in the run config
    ],
)
def test_a_request_is_validated_when_made(bad: dict, field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        PlanRequest(**bad)
    assert [e["loc"] for e in err.value.errors()] == [(field,)]


def test_a_derived_request_is_validated_too() -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        dataclasses.replace(PlanRequest(), context=-1)  # as longest_context derives its requests
    assert err.value.errors()[0]["loc"] == ("context",)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"dp": 3, "gpus": 8}, r"gpus \(8\) is not a multiple of dp \(3\)$"),
        ({"cp": 3, "gpus": 8}, r"gpus \(8\) is not a multiple of cp \(3\)$"),
        ({"dp": 2, "cp": 2, "gpus": 8}, r"dp \(2\) x cp \(2\) must equal gpus \(8\)$"),
    ],
)
def test_a_mesh_that_does_not_split_the_gpus_names_only_what_was_given(given, message) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        PlanRequest(**given)
    [error] = err.value.errors()
    assert re.search(message, str(error["ctx"]["error"]))


def test_dp_and_cp_default_to_what_the_other_leaves() -> None:
    assert (PlanRequest(gpus=8).data_parallel, PlanRequest(gpus=8).context_parallel) == (1, 8)
    assert (PlanRequest(gpus=8, dp=2).data_parallel, PlanRequest(gpus=8, dp=2).context_parallel) == (2, 4)
    assert (PlanRequest(gpus=8, cp=2).data_parallel, PlanRequest(gpus=8, cp=2).context_parallel) == (4, 2)


def test_longest_context_is_the_boundary_of_fitting() -> None:
    request = PlanRequest(
        model="test-llama", group=2, completion=8, engine=PLAN_ENGINE.updated(chunk_size=CHUNK),
        dtype=torch.float32, gpus=1, gpu_mem_bytes=2 * 2**30, mode="exact",
    )  # fmt: skip
    longest, plan = longest_context(request, low=1024, high=1 << 24)
    assert plan.fits and longest > 1024
    beyond = plan_memory(request.__class__(**{**request.__dict__, "context": longest + 1024}))
    assert not beyond.fits


def test_longest_context_at_the_search_bound_is_the_bound_less_one() -> None:
    """Every length below ``high`` fits: the answer is the search's bound, which the CLI says."""
    request = PlanRequest(
        model="test-llama",
        group=2,
        completion=8,
        engine=PLAN_ENGINE.updated(chunk_size=CHUNK),
        dtype=torch.float32,
        gpus=1,
        gpu_mem_bytes=10**15,
    )
    longest, plan = longest_context(request, low=1024, high=1 << 16)
    assert longest == (1 << 16) - 1 and plan.fits


def test_layer_inputs_are_planned_for_the_wavefront_walk_only() -> None:
    config = load_config("qwen3.6-27b")
    wavefront = PlanRequest(mode="exact", gpus=8)
    vector = config.hidden_size * 2  # bf16, per position
    # 64 layers: kept every 8th and after the last (9), one segment of 8 at a time: its first input kept, 7
    # recomputed (plus its rows); balanced over sharded weights every rank recomputes a segment when the first run
    # enters it, so a later run still holds its inputs of the segment before: at most 13 layers' of a rank's rows
    # (``engine.schedule.walk_inputs_held``: ranks 0, 6 and 7)
    kept, segment = layer_inputs_bytes(config, wavefront, 1000)
    # on top of the segment's inputs, one attention layer's rows of the others before a cell, 7 shards (rank 0's
    # later run: 14 parts of half a shard), and their fp32 sinks
    kv = 2 * config.num_key_value_heads * config.head_dim * 2
    assert kept == 1000 * vector * 9 and segment == 1000 * vector * 13 + 1000 * kv * 7 * 3
    in_order = PlanRequest(mode="exact", gpus=8, engine=PLAN_ENGINE.updated(balanced_captures=False))
    assert layer_inputs_bytes(config, in_order, 1000) == (kept, 1000 * vector * 7 + 1000 * kv * 7 * 3)
    every_layer = PlanRequest(mode="exact", gpus=8, engine=PLAN_ENGINE.updated(layer_inputs_every=1))
    assert layer_inputs_bytes(config, every_layer, 1000)[0] == 1000 * vector * 65
    for other in (
        PlanRequest(
            mode="exact", gpus=8, engine=PLAN_ENGINE.updated(wavefront_walk=False)
        ),  # every rank recomputes: nothing kept
        PlanRequest(mode="detached", gpus=8),
        PlanRequest(mode="exact", gpus=8, cp=1, dp=8),
        PlanRequest(
            mode="exact", gpus=8, engine=PLAN_ENGINE.updated(graph_budget_bytes=1 << 30)
        ),  # a kept-graph budget captures replicated
    ):
        assert layer_inputs_bytes(config, other, 1000) == (0, 0)


# parameters, the largest decoder layer's and the root unit's (embeddings, final norm, LM head), 10 layers
PROBE = Probe(graphs=0, parameters=8_000, largest_layer=700, root=1_000, layers=10)
# what is whole (weights, gradients) and the gradient shards, per phase; bf16 compute with fp32 masters unless said
NO_LANES = {"lane buffers (dp > 1)": 0}
BF16_CP8 = {"weights": 4_000, "optimizer state": 8_000, "reference weights": 0, **NO_LANES}


@pytest.mark.parametrize(
    ("request_args", "capture", "backward"),
    [
        # dp = 1 x cp = 8: a balanced capture's rank holds the root and cp layers (each gathered once per wave of
        # runs, from the step it is due to the rank's cell) and, as the step's first group, no gradient; a replay
        # holds one layer and its gradient (bf16, then fp32 on its way to the shards) and the root's, beside the
        # layers' gradient shards (the root's is whole until the step ends)
        (
            {"gpus": 8, "mode": "detached"},
            {**BF16_CP8, "gathered weights": (8 * 700 + 1_000) * 2, "gathered gradients": 0, "gradients": 0},
            {**BF16_CP8, "gathered weights": (700 + 1_000) * 2, "gathered gradients": 700 * 4 + (700 + 1_000) * 2,
             "gradients": 7_000 // 8 * 4},
        ),
        # a later group's capture: the root's gradient whole and the layers' shards the earlier backward left
        (
            {"gpus": 8, "mode": "detached", "groups_per_rank": 2},
            {**BF16_CP8, "gathered weights": (8 * 700 + 1_000) * 2, "gathered gradients": 1_000 * 2,
             "gradients": 7_000 // 8 * 4},
            {**BF16_CP8, "gathered weights": (700 + 1_000) * 2, "gathered gradients": 700 * 4 + (700 + 1_000) * 2,
             "gradients": 7_000 // 8 * 4},
        ),
        # exact mode's wavefront walk of a balanced cut over sharded weights (paced): a cell's layer, the cp of its
        # waves' gathers started by then, and the cp - 1 layers' gradients kept until their waves' reductions (bf16),
        # one reduction in flight (fp32)
        (
            {"gpus": 8, "mode": "exact"},
            {**BF16_CP8, "gathered weights": (8 * 700 + 1_000) * 2, "gathered gradients": 0, "gradients": 0},
            {**BF16_CP8, "gathered weights": (9 * 700 + 1_000) * 2,
             "gathered gradients": 7 * 700 * 2 + 700 * 4 + (700 + 1_000) * 2, "gradients": 7_000 // 8 * 4},
        ),
        # ... cut in rank order: cp + 1 layers whole and cp layers' fp32 reductions in flight (its capture holds the
        # last rank's layer and the cp - 1 gathers it starts ahead)
        (
            {"gpus": 8, "mode": "exact", "engine": PLAN_ENGINE.updated(balanced_captures=False)},
            {**BF16_CP8, "gathered weights": (8 * 700 + 1_000) * 2, "gathered gradients": 0, "gradients": 0},
            {**BF16_CP8, "gathered weights": (9 * 700 + 1_000) * 2,
             "gathered gradients": 8 * 700 * 4 + (700 + 1_000) * 2, "gradients": 7_000 // 8 * 4},
        ),
        # at cp = 2, a root larger than the layers
        (
            {"gpus": 2, "mode": "detached", "_root": 20_000},
            {"weights": 54_000, "optimizer state": 108_000, "reference weights": 0, **NO_LANES,
             "gathered weights": (2 * 700 + 20_000) * 2, "gathered gradients": 0, "gradients": 0},
            {"weights": 54_000, "optimizer state": 108_000, "reference weights": 0, **NO_LANES,
             "gathered weights": (700 + 20_000) * 2, "gathered gradients": 700 * 4 + (700 + 20_000) * 2,
             "gradients": 7_000 // 2 * 4},
        ),
        # dp = 2 x cp = 4: a layer at a time too, each dp rank for itself (parallel.lanes): in a capture the gathers
        # started ahead each hold their send buffer (1/dp of a layer, bf16): cp - 1 of them in a balanced capture ...
        (
            {"gpus": 8, "dp": 2, "mode": "detached"},
            {**BF16_CP8, "gathered weights": (4 * 700 + 1_000) * 2, "gathered gradients": 0, "gradients": 0,
             "lane buffers (dp > 1)": 3 * 350 * 2},
            {**BF16_CP8, "gathered weights": (700 + 1_000) * 2, "gathered gradients": 700 * 4 + (700 + 1_000) * 2,
             "gradients": 7_000 // 8 * 4},  # (a replay gathers as it computes: nothing in flight)
        ),
        # ... and in exact mode's wavefront walk each reduction in flight the rows it receives (1/dp of a layer, fp32)
        (
            {"gpus": 8, "dp": 2, "mode": "exact"},
            {**BF16_CP8, "gathered weights": (4 * 700 + 1_000) * 2, "gathered gradients": 0, "gradients": 0,
             "lane buffers (dp > 1)": 3 * 350 * 2},
            {**BF16_CP8, "gathered weights": (5 * 700 + 1_000) * 2,
             "gathered gradients": 3 * 700 * 2 + 700 * 4 + (700 + 1_000) * 2, "gradients": 7_000 // 8 * 4,
             "lane buffers (dp > 1)": 4 * 350 * 2 + 350 * 4},  # (paced: one reduction in flight)
        ),
        # one GPU: the fp32 masters, their moments and the bf16 compute copy; gradients in the backward
        (
            {"gpus": 1},
            {"weights": 32_000, "optimizer state": 64_000, "reference weights": 0, "gathered weights": 16_000,
             "gathered gradients": 0, "gradients": 0, **NO_LANES},
            {"weights": 32_000, "optimizer state": 64_000, "reference weights": 0, "gathered weights": 16_000,
             "gathered gradients": 0, "gradients": 32_000, **NO_LANES},
        ),
        # no mixed precision: AdamW steps bf16 shards with bf16 moments; a replay's gradient is reduced as it is
        (
            {"gpus": 8, "mode": "detached", "mixed_precision": False},
            {"weights": 2_000, "optimizer state": 4_000, "reference weights": 0, **NO_LANES,
             "gathered weights": (8 * 700 + 1_000) * 2, "gathered gradients": 0, "gradients": 0},
            {"weights": 2_000, "optimizer state": 4_000, "reference weights": 0, **NO_LANES,
             "gathered weights": (700 + 1_000) * 2, "gathered gradients": (700 + 1_000) * 2,
             "gradients": 7_000 // 8 * 2},
        ),
    ],
)  # fmt: skip
def test_parameter_phases_follow_the_trainers_schedule(request_args: dict, capture: dict, backward: dict) -> None:
    """What the trainer holds per GPU in a capture and in the backward passes (parallel.fsdp's schedule: the
    distributed tests measure it per rank), from the model's parameter counts."""
    root = request_args.pop("_root", PROBE.root)
    probe = dataclasses.replace(PROBE, parameters=PROBE.parameters - PROBE.root + root, root=root)
    request = PlanRequest(dtype=torch.bfloat16, **request_args)
    assert parameter_phases(probe, request) == {"capture": capture, "backward": backward}
    with_reference = parameter_phases(probe, dataclasses.replace(request, beta=0.04))
    # the KL reference sharded as the policy: its shards, and what the step holds whole (one GPU: the whole copy)
    expected = probe.parameters * request.master_itemsize
    if request.gpus > 1:
        shard = -(-probe.parameters // request.shard_ranks) * request_itemsize(request)  # (frozen: compute dtype)
        expected = shard * (not request.offload) + probe.root * request_itemsize(request)
    assert with_reference["capture"]["reference weights"] == with_reference["backward"]["reference weights"]
    assert with_reference["capture"]["reference weights"] == expected


def request_itemsize(request: PlanRequest) -> int:
    return torch.empty((), dtype=request.dtype).element_size()


def test_offload_moves_the_shards_their_gradients_and_adamw_to_the_host() -> None:
    """``offload`` (FSDP2's CPU offload): the device keeps what is whole (gathered weights and gradients), the host
    the rank's master shards, their gradients and AdamW's moments — the same bytes the device held without it."""
    request = PlanRequest(dtype=torch.bfloat16, gpus=8)
    kept, moved = parameter_phases(PROBE, request), parameter_phases(PROBE, dataclasses.replace(request, offload=True))
    for phase in kept:
        assert moved[phase]["weights"] == moved[phase]["gradients"] == moved[phase]["optimizer state"] == 0, phase
        assert kept[phase]["weights"] > 0 and kept[phase]["optimizer state"] > 0, phase
        for role in ("gathered weights", "gathered gradients"):
            assert moved[phase][role] == kept[phase][role], (phase, role)
    shard = -(-PROBE.parameters // 8) * 4
    offloaded = dataclasses.replace(request, offload=True)
    host = {"weights": shard, "gradients": shard, "optimizer state": 2 * shard, "reference weights": 0}
    assert planning.host_terms(PROBE, offloaded) == host
    with_reference = dataclasses.replace(offloaded, beta=0.04)  # the reference's shards on the host too, in bf16
    assert planning.host_terms(PROBE, with_reference) == host | {"reference weights": shard // 2}
    assert planning.host_terms(PROBE, request) == {}
    with pytest.raises(pydantic.ValidationError, match="offload runs through FSDP2"):
        PlanRequest(gpus=1, offload=True)


def test_a_plan_is_the_phase_that_holds_the_most() -> None:
    """At cp = 2 the capture of a long context holds its hidden states and the earlier rank's rows beside 3 layers;
    a short one holds less than a replay's layer, its gradients and the gradient shards."""
    config = TINY_PRESETS["llama"]()
    for context, phase in ((1 << 20, "capture"), (64, "backward")):
        request = PlanRequest(model="tiny-llama", context=context, gpus=2, dtype=torch.bfloat16)
        measured = _Measured(config, parameter_phases(PROBE, request), 0, "", (PROBE.parameters, 0), {})
        plan = _plan(request, measured)
        phases = _phase_categories(measured, planning.exact_terms(config, request, context // 2))
        assert plan.categories == phases[phase] and sum(phases[phase].values()) > sum(
            phases["backward" if phase == "capture" else "capture"].values()
        )
        assert f"the step's peak is in its {phase} phase" in plan.notes[2]


def test_mixed_precision_needs_a_narrow_compute_dtype() -> None:
    with pytest.raises(pydantic.ValidationError, match="narrower than its fp32 masters"):
        PlanRequest(dtype=torch.float32, mixed_precision=True)
    assert not PlanRequest(dtype=torch.float32).mixed and PlanRequest(dtype=torch.bfloat16).mixed


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"turns": 3}, "give history"),
        ({"history": 1000, "turns": 200, "completion": 8}, "cannot hold 200 turns"),
        ({"history": -1}, "greater than or equal to 0"),
    ],
)
def test_an_agent_shape_is_validated(given: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        PlanRequest(**given)


@pytest.mark.parametrize(
    ("shape", "sharded"),
    [
        # exact mode fuses turns whose tool outputs fit a chunk: all but the last answer, one node after the root
        ({"mode": "exact", "history": 1536, "turns": 16, "completion": 32, "context": 256}, 1504),
        ({"mode": "exact", "history": 1536, "turns": 16, "completion": 32, "context": 2048}, 0),  # shorter than it
        # longer tool outputs stay apart: the first one after the root
        ({"mode": "exact", "history": 1536, "turns": 8, "completion": 32, "context": 100}, 160),
        ({"mode": "exact", "history": 1536, "turns": 8, "completion": 32, "context": 256}, 0),
        # detached mode extends each tool output apart
        ({"mode": "detached", "history": 1536, "turns": 4, "completion": 32, "context": 256}, 352),
        ({"mode": "detached", "history": 1536, "turns": 16, "completion": 32, "context": 256}, 0),
    ],
)
def test_the_history_is_planned_sharded_where_the_engine_shards_it(shape: dict, sharded: int) -> None:
    request = PlanRequest(gpus=2, cp=2, engine=EngineConfig(chunk_size=128), **shape)
    assert request.sharded_history == sharded
    assert request.walked_back_sharded == (sharded > 0 and request.mode == "exact")
    threshold = PlanRequest(gpus=2, cp=2, engine=EngineConfig(chunk_size=128, sharded_extend_tokens=8), **shape)
    assert threshold.sharded_history > 0  # every extend of 8 tokens or more
    budget = EngineConfig(chunk_size=128, graph_budget_bytes=1 << 20)
    assert PlanRequest(gpus=2, cp=2, engine=budget, **shape).sharded_history == 0  # kept graphs: replicated


def test_expert_parallelism_gathers_a_layer_without_its_experts() -> None:
    """Under expert parallelism (``parallel.experts``) a gather leaves a layer's routed experts out and every extend
    is replicated (one layer whole in a capture, not cp + 1); the MoE layer whose gathered part plus the rank's share
    of its experts is the most sets what is whole; a cast copy of those experts (mixed precision) and their
    gradient on its way into the shard are held beside it. The distributed test measures it per rank."""
    # two layers: a dense one of 500 parameters, a MoE one of 400 beside 800 routed experts (200 per rank of 4)
    probe = dataclasses.replace(PROBE, largest_layer=1_200, layers=2, routed=(0, 800), in_layers=(500, 1_200))
    engine = PLAN_ENGINE.updated(sharded_extends=False)
    request = PlanRequest(dtype=torch.bfloat16, gpus=4, expert_parallel=True, engine=engine)
    assert probe.whole_layer(request) == (400, 200)  # (the dense layer's 500 are fewer)
    phases = parameter_phases(probe, request)
    root = PROBE.root
    assert phases["capture"]["gathered weights"] == (400 + root) * 2 + 200 * 2  # one layer, its experts cast
    assert phases["backward"]["gathered weights"] == (400 + root) * 2
    # the layer's mixed-precision gradient in fp32 on its way to the shard, the whole gradients, and the most of the
    # experts' cast again (2 bytes each) or, the cast freed, their gradient going into the shard a stacked weight
    # at a time: gate_up_proj's (2/3 of them) fp32 copy, then the shard's gradient plus it, its bf16 one freed
    experts = max(200 * 2, round(200 * 2 / 3 * (4 + 4 - 2)))
    assert phases["backward"]["gathered gradients"] == 400 * 4 + (400 + root) * 2 + experts
    plain = parameter_phases(probe, dataclasses.replace(request, expert_parallel=False, engine=PLAN_ENGINE))
    assert plain["capture"]["gathered weights"] == (2 * 1_200 + root) * 2  # cp + 1 = 2 layers whole, experts too


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gpus": 4, "cp": 1}, "needs cp > 1"),
        ({"gpus": 4, "dp": 2, "cp": 2}, "at dp > 1 needs hsdp"),
    ],
)
def test_expert_parallelism_is_validated(given: dict, message: str) -> None:
    engine = PLAN_ENGINE.updated(sharded_extends=False)
    with pytest.raises(pydantic.ValidationError, match=message):
        PlanRequest(**({"expert_parallel": True, "engine": engine} | given))
    with pytest.raises(ValueError, match="needs a mixture of experts"):
        plan_memory(PlanRequest(model="tiny-llama", context=64, gpus=2, expert_parallel=True, engine=engine))
    # sharded extends under expert parallelism: tokens dispatched (``parallel.expert_dispatch``), a replicated walk
    dispatched = PlanRequest(gpus=4, mode="exact", expert_parallel=True, expert_dispatch=True, engine=PLAN_ENGINE)
    assert dispatched.dispatched and not dispatched.wavefront and dispatched.balanced_context
    replicated = PlanRequest(gpus=4, expert_parallel=True, engine=PLAN_ENGINE)  # (the run's default)
    assert not replicated.dispatched and not replicated.sharded_extends and not replicated.sampler_shards
    with pytest.raises(pydantic.ValidationError, match="expert_dispatch shards long extends"):
        PlanRequest(gpus=4, expert_parallel=True, expert_dispatch=True, engine=engine)


def test_a_capture_cell_reads_the_other_ranks_rows_before_it() -> None:
    """Per cp rank of 4, the rows a sharded capture's cell reads at once (beside the rank's hidden states): cut in
    rank order the earlier ranks' shards, r of them; balanced (either mode), those before the rank's later run but
    its own first, 2·4 - 2 - r parts of half a shard."""
    config = TINY_PRESETS["llama"]()

    def rows(mode: str, rank: int, balanced: bool = True) -> int:
        request = PlanRequest(
            model="tiny-llama", context=1_000_000, gpus=4, mode=mode, cp_rank=rank, dtype=torch.bfloat16,
            engine=PLAN_ENGINE.updated(balanced_captures=balanced),
        )  # fmt: skip
        return planning.capture_rows_bytes(config, request) - 250_000 * config.hidden_size * 2

    shard = rows("exact", 1, balanced=False)
    assert [rows("exact", r, balanced=False) for r in range(4)] == [r * shard for r in range(4)]
    for mode in ("detached", "exact"):
        assert [rows(mode, r) for r in range(4)] == [(6 - r) * shard // 2 for r in range(4)]


def _capture_layers_whole(cp: int, layers: int, balanced: bool) -> list[int]:
    """Per cp rank, the most layers a sharded capture of ``4·cp`` chunks holds whole (taken or started ahead) as
    ``ShardedCapture`` paces its gathers: before its cell at wavefront step s a rank starts every gather due by s,
    in ``capture_gathers``' order, freeing at once one it computes nothing with; it frees a layer after its cell."""
    runs = runs_of([owner for lo, hi, owner in cut_runs(4 * cp, cp, balanced) for _ in range(lo, hi)])
    return [_rank_layers_whole(runs, layers, rank) for rank in range(cp)]


def _rank_layers_whole(runs: list[Run], layers: int, rank: int) -> int:
    wave_of = {run.index: w for w, wave in enumerate(waves(runs)) for run in wave}
    computes = {(wave_of[run.index], i) for run in runs if run.owner == rank for i in range(layers)}
    coming, held, peak = collections.deque(capture_gathers(runs, layers)), set(), 0
    for cell in [*wavefront_cells(runs, layers, rank), None]:  # (None: after the last, every gather left)
        step = None if cell is None else cell[0].index + cell[1]
        while coming and (step is None or coming[0].due <= step):
            gather = coming.popleft()
            assert gather.layer not in {layer for _, layer in held}  # (a unit is gathered once at a time)
            held.add((gather.wave, gather.layer))
            peak = max(peak, len(held))
            if (gather.wave, gather.layer) not in computes:
                held.discard((gather.wave, gather.layer))
        if cell is not None:
            held.discard((wave_of[cell[0].index], cell[1]))
    assert not held
    return peak


def test_a_balanced_capture_gathers_each_layer_once_per_wave_of_runs() -> None:
    """Per cp rank of 8, the layers a sharded capture holds whole, as the engine paces its gathers and as the
    planner counts them: balanced, each layer is gathered once for the ranks' first runs and once for their later
    ones, so every rank holds ``cp`` (rather than rank 0 each layer from its first run's cell to its later one's,
    2cp - 1); in rank order (the wavefront walk's, or ``EngineConfig.balanced_captures`` off) the layer it computes
    and r ahead."""
    layers = 40
    runs = runs_of([owner for lo, hi, owner in cut_runs(16, 8, True) for _ in range(lo, hi)])
    assert [[run.owner for run in wave] for wave in waves(runs)] == [list(range(8)), list(range(6, -1, -1))]
    assert len(waves(runs_of([owner for lo, hi, owner in cut_runs(16, 8, False) for _ in range(lo, hi)]))) == 1
    requests = [PlanRequest(gpus=8, dtype=torch.bfloat16, cp_rank=r, mode="detached") for r in range(8)]
    assert [r.capture_layers_whole(balanced=True) for r in requests] == [8] * 8
    assert _capture_layers_whole(8, layers, balanced=True) == [8] * 8
    assert [r.capture_layers_whole(balanced=False) for r in requests] == [1 + r for r in range(8)]
    assert _capture_layers_whole(8, layers, balanced=False) == [1 + r for r in range(8)]
    # the planner counts on a short cut and depth (``engine.schedule``): the same as 4 chunks a rank and 40 layers
    for cp in (2, 3, 4, 5):
        for balanced in (True, False):
            counted = [capture_layers_whole(cp, rank, balanced) for rank in range(cp)]
            assert counted == _capture_layers_whole(cp, layers, balanced), (cp, balanced)
    in_order = PLAN_ENGINE.updated(balanced_captures=False)
    assert requests[0].balanced_context and not dataclasses.replace(requests[0], engine=in_order).balanced_context
    assert dataclasses.replace(requests[0], mode="exact").balanced_context  # (its wavefront walk walks the cut)


def _paced_walk_holds(cp: int, layers: int, every: int, rank: int) -> tuple[int, int]:
    """Exact mode's balanced walk over sharded weights on cp rank ``rank`` (``walk_schedule``), as ``LayerGather``
    would run it: the most layers whole at once (started or taken) and the most gradients kept beside a cell's. It
    fails where the rank would gather a layer out of the one order every rank follows, gather a unit that is whole
    or in flight, recompute over a kept gradient, walk a cell whose gather was not started, reduce a wave it gave
    no gradient, or end with anything held."""
    runs = runs_of([owner for lo, hi, owner in cut_runs(6 * cp, cp, True) for _ in range(lo, hi)])
    wave_runs = waves(runs)
    schedule = walk_schedule(runs, layers, every, rank)
    order = [
        layer
        for event in (item for item in schedule if not isinstance(item, tuple))
        for layer in (range(event.first, event.top) if isinstance(event, SegmentRecompute) else [])
    ]
    coming = collections.deque(order)  # (the recomputations' gathers; a wave's is checked as it starts)
    started: set[int] = set()
    kept: set[int] = set()
    whole = most_kept = 0
    for item in schedule:
        if isinstance(item, SegmentRecompute):
            for layer in range(item.first, item.top):
                assert coming.popleft() == layer and layer not in started and layer not in kept
                whole = max(whole, len(started) + 1)
        elif isinstance(item, WaveGather):
            assert item.layer not in started  # (a unit gathers once at a time)
            started.add(item.layer)
            whole = max(whole, len(started))
            if not any(run.owner == rank for run in wave_runs[item.wave]):
                started.discard(item.layer)  # (taken and freed at once)
        elif isinstance(item, WaveReduction):
            assert (item.layer in kept) == any(run.owner == rank for run in wave_runs[item.wave])
            kept.discard(item.layer)
        else:
            _, layer = item
            assert layer in started and layer not in kept
            most_kept = max(most_kept, len(kept))
            started.discard(layer)
            kept.add(layer)
    assert not coming and not started and not kept
    return whole, most_kept


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_paced_walk_keeps_one_order_and_holds_what_the_planner_counts(cp: int) -> None:
    """Each rank of a balanced walk over sharded weights (40 layers, segments of 4 and of one layer) follows one
    order of gathers and reductions, never gathers a unit twice at once, and holds no more layers whole than the
    planner counts per rank (``walk_gathers_ahead`` + the cell's: cp + 1, the last rank 1) nor more gradients kept
    for their waves' reductions than cp - 1."""
    for every in (4, 1):
        for rank in range(cp):
            request = PlanRequest(gpus=cp, mode="exact", cp_rank=rank, dtype=torch.bfloat16)
            assert request.paced_walk
            whole, kept = _paced_walk_holds(cp, 40, every, rank)
            assert whole <= request.walk_gathers_ahead + 1 and kept <= cp - 1, (every, rank, whole, kept)
            # what the planner counts (``engine.schedule.walk_holds``, a short cut and depth) is what it holds
            assert walk_holds(cp, rank, every) == WalkHolds(whole, kept) == request.walk_holds(), (every, rank)


def _walk_inputs(cp: int, layers: int, every: int, rank: int, paced: bool) -> float:
    """The most recomputed layer inputs rank ``rank`` holds at once in exact mode's walk (a balanced cut of 3 chunks
    a run), in its rows, as ``WavefrontWalk`` keeps them: a segment's recomputation makes an input for each of its
    layers (the first a view of the kept one, counted as nothing), for all the rank's runs at once when paced, for
    the run entering it otherwise. It fails where a cell's input was not made, an input is made twice, or one is
    left held."""
    runs = runs_of([owner for lo, hi, owner in cut_runs(6 * cp, cp, True) for _ in range(lo, hi)])
    mine = [run for run in runs if run.owner == rank]
    rows = {run.index: len(run.chunks) for run in mine}
    held: set[tuple[int, int]] = set()
    most = 0.0

    def recompute(first: int, top: int, entering: list[Run]) -> None:
        nonlocal most
        for run in entering:
            for layer in range(first, top + 1):
                assert (run.index, layer) not in held
                held.add((run.index, layer))
        new = sum(rows[i] for i, layer in held if layer % every)  # (a segment's first: the kept input's view)
        most = max(most, new / sum(rows.values()))

    for item in walk_schedule(runs, layers, every, rank) if paced else walk_cells(runs, layers, rank):
        if isinstance(item, SegmentRecompute):
            recompute(item.first, item.top, mine)
        elif isinstance(item, tuple):
            run, i = item
            if not paced and (run.index, i) not in held:  # (entering its segment at the top)
                recompute(i - i % every, i, [run])
            held.remove((run.index, i))
    assert not held
    return most


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_walks_recomputed_inputs_are_what_the_planner_counts(cp: int) -> None:
    """The recomputed layer inputs a rank holds at once in exact mode's walk, counted by the planner on a short cut
    (``engine.schedule.walk_inputs_held``), equal those of a longer walk (40 layers): up to a segment's
    ``every - 1`` unpaced (a rank's runs enter a segment apart); paced, a later run's inputs of the segment before
    as well."""
    for every in (1, 2, 4, 8):
        for rank in range(cp):
            for paced in (True, False):
                held = _walk_inputs(cp, 40, every, rank, paced)
                assert walk_inputs_held(cp, rank, 40, every, paced) == held, (every, rank, paced)
                # (the closed form the planner used before: at most a segment's, paced up to cp - 1 more; the last
                # rank, one run, a segment's at least)
                assert held <= min(every - 1 + (cp - 1 if paced else 0), 39) and (rank < cp - 1 or held >= every - 1)
    request = PlanRequest(gpus=cp, mode="exact", dtype=torch.bfloat16)  # (by default the most of any rank)
    most = max(_walk_inputs(cp, 40, 4, rank, paced=True) for rank in range(cp))
    assert request.paced_walk and request.walk_inputs_held(40, 4) == most
    assert dataclasses.replace(request, cp_rank=1).walk_inputs_held(40, 4) == _walk_inputs(cp, 40, 4, 1, paced=True)


def test_the_engine_and_the_planner_shard_an_extend_by_one_rule() -> None:
    """``engine.schedule.shards_extend``: sharded when at least as long as what it extends, or as the threshold;
    the planner's member history follows it (a 7,168-token tool output after the path before it)."""
    assert shards_extend(10, 10, None) and not shards_extend(9, 10, None) and not shards_extend(0, 0, None)
    assert shards_extend(5, 10, 5) and not shards_extend(4, 10, 5)

    def history(context: int, least: int | None = None) -> int:
        engine = PLAN_ENGINE.updated(sharded_extend_tokens=least)
        request = PlanRequest(gpus=2, mode="exact", context=context, history=8192, turns=1, engine=engine)
        return request.sharded_history

    assert history(7169) == 7168 and history(7170) == 0 and history(7170, least=7168) == 7168


def test_the_shipped_model_names_are_known_without_torch() -> None:
    """``longstraw plan`` checks ``--model`` against ``plan.shape.MODEL_NAMES`` before importing torch: the names
    ``NAMED_MODELS`` ships with (tests add ``test-*`` ones)."""
    shipped = {name for name in planning.NAMED_MODELS if not name.startswith("test-")}
    assert shipped == set(MODEL_NAMES)
    assert model_problem("qwen3.6-27b") is None and "unknown model 'qwen9'" in str(model_problem("qwen9"))


def test_a_model_file_that_does_not_exist_is_named_as_such(tmp_path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(pydantic.ValidationError, match=f"{missing} does not exist"):
        PlanRequest(model=str(missing))
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        load_config(str(missing))
    with pytest.raises(pydantic.ValidationError, match="holds no config.json"):
        PlanRequest(model=str(tmp_path))
    (tmp_path / "config.json").write_text(TINY_PRESETS["llama"]().to_json_string())
    assert load_config(str(tmp_path)).model_type == "llama"


def plan_of_total(total: int, gpu_mem_bytes: int) -> planning.Plan:
    """A plan on one GPU whose total (its one category and the allocator margin) is ``total`` bytes, or just below."""
    low, high = 0, total
    while low < high - 1:  # the largest category whose total does not pass ``total`` (the margin rounds down)
        middle = (low + high) // 2
        low, high = (middle, high) if middle + _margin(middle) <= total else (low, middle)
    request = PlanRequest(model="tiny-llama", gpus=1, gpu_mem_bytes=gpu_mem_bytes)
    return planning.Plan(request, {"weights": low})


def total_line(plan: planning.Plan) -> str:
    [line] = [line for line in plan.table().splitlines() if line.strip().startswith("total")]
    return line.split(maxsplit=1)[1]


def test_the_total_and_the_gpus_memory_are_rounded_alike() -> None:
    """96 GB is 89.4070 GiB: a total of 89.4056 GiB fits and one of 89.4084 GiB does not, though both round to 89.41
    (the table once printed "89.41 of 89.4 GiB: fits"); where the figures read the same, it says by how much."""
    gpu = 96 * 10**9
    fitting, over = plan_of_total(gpu - 2**20 - 1000, gpu), plan_of_total(gpu + 2**20 + 1000, gpu)
    assert fitting.fits and not over.fits
    assert total_line(fitting) == "89.41  of 89.41 GiB: fits (by 1.0 MiB)"
    assert total_line(over) == "89.41  of 89.41 GiB: does NOT fit (by 1.0 MiB)"
    assert total_line(plan_of_total(80 * 2**30, gpu)) == "80.00  of 89.41 GiB: fits"
    for total in range(gpu - 50 * 2**20, gpu + 50 * 2**20, 2**20 // 3):  # printed figures never contradict the verdict
        shown, _, of, _, verdict = total_line(plan_of_total(total, gpu)).split(maxsplit=4)
        assert (float(shown) <= float(of)) if verdict.startswith("fits") else (float(shown) >= float(of))


def test_a_mixture_of_experts_that_fits_only_with_expert_parallelism_is_told_so() -> None:
    """Without expert parallelism a MoE's step may not fit where it does with it and offload (GLM-5.2 at 2.1M on 32
    GPUs: the published layout): the alternative is that layout; serving the policy, which helps only a step that
    fits, is not offered."""
    dense = PlanRequest(model="tiny-llama", context=4000, gpus=2, engine=PLAN_ENGINE.updated(chunk_size=1000))
    assert planning.expert_parallel_alternative(dense) is None
    moe = dataclasses.replace(dense, model="tiny-glm_moe_dsa", group=2, completion=16)
    alternative = planning.expert_parallel_alternative(moe)
    assert alternative is not None
    assert (alternative.expert_parallel, alternative.offload, alternative.hsdp) == (True, True, False)
    assert planning.expert_parallel_alternative(alternative) is None
    at_dp_2 = planning.expert_parallel_alternative(dataclasses.replace(moe, gpus=4, dp=2))
    assert at_dp_2 is not None and at_dp_2.hsdp
    assert planning.expert_parallel_alternative(dataclasses.replace(moe, cp=1, dp=2)) is None


def test_serving_the_policy_is_offered_only_for_a_step_that_fits() -> None:
    request = PlanRequest(model="tiny-llama", gpus=2, gpu_mem_bytes=10 * 2**30)
    rollouts_over = {"sampler state": 20 * 2**30}
    step_fits = planning.Plan(request, {"weights": 2**30}, rollout=rollouts_over).table().splitlines()
    assert step_fits[-1].endswith("does NOT fit: serve the policy instead (policy.served)")
    neither = planning.Plan(request, {"weights": 20 * 2**30}, rollout=rollouts_over).table().splitlines()
    assert neither[-1].endswith("does NOT fit") and "serve the policy" not in "\n".join(neither)


LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def measured_lora_peak(family: str, mode: str, group: int, context: int) -> int:
    """As ``measured_peak``, for a LoRA policy: only the adapters have gradients (allocated beforehand)."""
    from longstraw_agents.models.lora import LoraSpec, apply_lora

    config = TINY_PRESETS[family](layers=LAYERS[family])
    model = apply_lora(build_model(config, dtype=torch.float32), LoraSpec(**LORA))
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, context)
    completions = [rng.integers(0, config.vocab_size, COMPLETION) for _ in range(group)]
    engine = Engine(model, EngineConfig(chunk_size=CHUNK))
    peak = grpo_backward(engine, prompt, completions, [float(k % 2) for k in range(group)], mode, track_memory=True)
    assert peak.peak_bytes is not None
    return peak.peak_bytes


def test_a_lora_policys_planned_peak_is_within_ten_percent_of_the_measured_one() -> None:
    """The probes carry the adapters: a frozen weight's backward holds no weight gradient (the LM head's fp32 one
    included), which the planned graph must not count either."""
    from longstraw_agents.models.lora import LoraSpec

    family, mode, group, context = "llama", "exact", 2, 512
    request = PlanRequest(
        model=f"test-{family}", context=context, group=group, completion=COMPLETION, gpus=1, mode=mode,
        dtype=torch.float32, optimizer="none", engine=EngineConfig(chunk_size=CHUNK), lora=LoraSpec(**LORA),
    )  # fmt: skip
    plan = plan_memory(request)
    planned = sum(v for k, v in plan.categories.items() if k not in STATIC)
    measured = measured_lora_peak(family, mode, group, context)
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)
    assert any(note.startswith("LoRA r=4") for note in plan.notes)


def test_a_lora_policy_plans_gradients_and_adamw_state_for_its_adapters_only() -> None:
    """Every weight is kept (frozen, in its shard); the gradients, their shards and AdamW's moments are the
    adapters' (the third case of the schedule test above, with 800 of the 8,000 parameters training, 80 at most
    in a layer, none in the root)."""
    from longstraw_agents.models.lora import LoraSpec

    probe = dataclasses.replace(PROBE, trained=800, trained_root=0, trained_layer=80, head_trains=False)
    request = PlanRequest(gpus=8, mode="detached", mixed_precision=False, dtype=torch.bfloat16, lora=LoraSpec())
    assert parameter_phases(probe, request)["backward"] == {
        "weights": 2_000, "optimizer state": 2 * 2 * 100, "reference weights": 0, **NO_LANES,
        "gathered weights": (700 + 1_000) * 2, "gathered gradients": (80 + 0) * 2, "gradients": 800 // 8 * 2,
    }  # fmt: skip


def test_a_lora_probe_counts_the_adapters_that_train() -> None:
    from longstraw_agents.models.lora import LoraSpec

    config = load_config("test-llama")
    model = planning.meta_model(config, torch.float32, LoraSpec(**LORA))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    h, mlp, r = config.hidden_size, config.intermediate_size, LORA["r"]
    kv = config.num_key_value_heads * h // config.num_attention_heads
    # r x (in + out) for each of q, k, v, o, gate, up, down: A, then B
    per_layer = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + mlp) + (mlp + h))
    assert trained == config.num_hidden_layers * per_layer and not model.lm_head.weight.requires_grad
