"""The time model's work counts against torch's FLOP counter over the real engine, and its calibration."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.base import causal_pairs
from longstraw_agents.models.mla import MoE
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.parallel.experts import ExpertShard
from longstraw_agents.plan import (
    PROFILES,
    Efficiency,
    HardwareProfile,
    ModelWork,
    PlanRequest,
    Schedule,
    Work,
    calibrate,
    load_config,
    measured_profile,
    step_time,
    step_work,
)
from longstraw_agents.trainer import grpo_backward

aten = torch.ops.aten
PROMPT, COMPLETION, GROUP, CHUNK = 96, 12, 3, 32


def _attention(q, k, v, dropout_p=0.0, is_causal=False, *args, **kwargs) -> float:
    """A fused kernel's FLOPs: queries aligned to the end of the keys, the masked triangle skipped."""
    batch, heads, n, dk = q
    m, dv = k[-2], v[-1]
    pairs = causal_pairs(n, m - n) if is_causal else n * m
    return 2 * batch * heads * pairs * (dk + dv)


def _attention_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, **kwargs) -> float:
    return 2.5 * _attention(q, k, v, dropout_p, is_causal)  # as torch's own formula for the fused backward


def _triangular_solve(a, b, *args, **kwargs) -> float:
    return math.prod(b[:-2]) * a[-1] * a[-1] * b[-1]


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor | None = None, *args: Any, **kwargs: Any) -> float:
    """torch's grouped matmul (a MoE's experts, ``models.grouped``), which torch's counter does not know: the rows
    (``[R, p] x [G, p, q]``) or the contracted rows (``[p, R] x [R, q]``) up to the last group's end only (rows past
    it belong to another rank's experts and are not computed)."""
    assert offs is not None
    rows = int(offs[-1]) if len(offs) else 0
    return float(2 * rows * (a.shape[1] * b.shape[-1] if b.dim() == 3 else a.shape[0] * b.shape[1]))


_grouped_mm._get_raw = True  # type: ignore[attr-defined]  # (FlopCounterMode: the tensors, for the offsets)

KERNELS = {
    aten._grouped_mm: _grouped_mm,
    aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
    aten.linalg_solve_triangular: _triangular_solve,
}
ATTENTION_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
)


def _counted(run) -> tuple[float, float]:
    """Total FLOPs torch counts for ``run()`` (matmuls, convolutions, the kernels above) and the attention ops'."""
    with FlopCounterMode(display=False, custom_mapping=KERNELS) as counter:
        run()
    by_op = counter.get_flop_counts()["Global"]
    attention = sum(
        count for op, count in by_op.items() if op in {o.default for o in ATTENTION_OPS} or op in ATTENTION_OPS
    )
    return float(counter.get_total_flops()), float(attention)


def _request(name: str, mode: str = "exact") -> PlanRequest:
    return PlanRequest(
        model=f"tiny-{name}", context=PROMPT, group=GROUP, completion=COMPLETION, gpus=1, dtype=torch.float32,
        engine=EngineConfig(chunk_size=CHUNK), mode=mode,
    )  # fmt: skip


def _step_inputs(name: str) -> tuple[Any, torch.nn.Module, Engine, Tensor, list[Tensor]]:
    """A tiny model of family ``name`` (fp32, seeded), its engine, a prompt and ``GROUP`` completions whose first
    tokens differ (no branch shares a node with another)."""
    config = TINY_PRESETS[name]()
    torch.manual_seed(0)
    model = build_model(config, dtype=torch.float32)
    engine = Engine(model, EngineConfig(chunk_size=CHUNK))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (PROMPT,), generator=gen)
    completions = [torch.randint(0, config.vocab_size, (COMPLETION,), generator=gen) for _ in range(GROUP)]
    for k, completion in enumerate(completions):
        completion[0] = k
    return config, model, engine, prompt, completions


@pytest.fixture(scope="module", params=list(TINY_PRESETS))
def measured(request):
    """Per family: torch's counts of a capture, a detached step and an exact step, and the model's phases."""
    name = request.param
    config, model, engine, prompt, completions = _step_inputs(name)
    rewards = [0.0, 1.0, 0.5]

    def step(mode: str):
        model.zero_grad(set_to_none=True)
        return lambda: grpo_backward(engine, prompt, completions, rewards, mode)

    with torch.no_grad():
        capture = _counted(lambda: engine.capture(prompt[:-1]))  # a step's last prompt token starts each branch
    counted = {"capture": capture, "detached": _counted(step("detached")), "exact": _counted(step("exact"))}
    phases = step_work(_request(name), ModelWork.of(config, torch.float32), rollout=False).phases
    return name, counted, phases


def _modelled(phases: dict[str, Work], names: tuple[str, ...]) -> Work:
    result = Work()
    for name in names:
        result = result + phases[name]
    return result


STEPS = {"capture": ("capture",), "detached": ("capture", "replay"), "exact": ("capture", "replay", "walk")}


@pytest.mark.parametrize("step", list(STEPS))
def test_flops_of_each_phase_match_torchs_count_of_the_real_run(measured, step):
    """Weight matmuls (a mixture of experts' routed share), attention pairs as the kernels compute them, the delta
    rule, DSA's index scores (counted as scores; no backward), the capture's last layer computing its state entries
    alone, the head's tiles recomputed in backward, exact mode's walk recomputing whole layers: within 2 % of
    torch's count."""
    name, counted, phases = measured
    modelled = _modelled(phases, STEPS[step])
    config = TINY_PRESETS[name]()
    per_score = 2 * config.index_n_heads * (config.index_head_dim + 1) if name == "glm_moe_dsa" else 0
    assert counted[step][0] == pytest.approx(modelled.flops + per_score * modelled.selection, rel=0.02), (name, step)


@pytest.mark.parametrize("step", list(STEPS))
def test_attention_flops_are_the_fused_kernels(measured, step):
    """The modelled attention is what the fused kernels compute; with DSA, every chunk here reaches past
    ``index_topk``, so its selected rows are attended with batched products and the fused kernels do nothing (those
    products are in the total count of the test above; its modelled attention is not zero)."""
    name, counted, phases = measured
    modelled = _modelled(phases, STEPS[step])
    sparse = name == "glm_moe_dsa"
    assert not sparse or modelled.attention > 0
    fused = 0.0 if sparse else modelled.attention + modelled.attention_backward
    assert counted[step][1] == pytest.approx(fused, rel=1e-6), (name, step)


def test_cp_rank_computes_its_shard_and_receives_the_earlier_rows():
    """Exact mode's capture cut in rank order (``balanced_captures: false``): the last rank is the slowest."""
    config = TINY_PRESETS["llama"]()
    model = ModelWork.of(config, torch.float32)
    one = step_work(_request("llama"), model, rollout=False).phases
    shard = (PROMPT - 1) // 2  # the captured positions of the first rank (the last has the one more)
    in_order = EngineConfig(chunk_size=CHUNK, balanced_captures=False)
    two_ranks = PlanRequest(**{**_request("llama").__dict__, "gpus": 2, "cp": 2, "engine": in_order})
    two = step_work(two_ranks, model, rollout=False).phases
    assert two["capture"].matmul == pytest.approx(one["capture"].matmul * (PROMPT - 1 - shard) / (PROMPT - 1))
    assert two["capture"].attention == pytest.approx(model.chunked(shard, PROMPT - 1, CHUNK, True).attention)
    rows = model.entries_bytes(shard)
    gathers = model.weight_bytes / 2  # FSDP2 over the two ranks: one gather of every layer
    assert two["capture"].comm == pytest.approx(rows + gathers)
    # replicated branch replays: every token's matmuls on every rank, attention to the rank's shard only
    assert two["replay"].matmul == pytest.approx(one["replay"].matmul)
    assert two["replay"].attention < one["replay"].attention
    assert one["capture"].comm == one["replay"].comm == 0


def test_calibration_recovers_the_rates_that_made_the_times():
    rates = dict(matmul=0.5, attention=0.2, attention_backward=0.1, recurrent=0.05, memory=0.6, link=0.5)
    truth = HardwareProfile(
        name="truth", peak_flops=1e12, memory_bandwidth=1e11, link_bandwidth=1e10, launch_s=2e-4,
        branch_call_s=5e-4, decode_call_s=1e-3, selection_s=3e-10, efficiency=Efficiency(**rates), measured_on="-",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    scales = {"matmul": 1e12, "attention": 1e11, "attention_backward": 1e11, "recurrent": 1e10, "selection": 1e9}
    scales |= {"memory": 1e10, "launches": 1e3, "branch_calls": 1e3, "decode_calls": 1e3}
    samples = []
    for _ in range(16):
        work = Work(**{name: float(rng.uniform(0.1, 1.0)) * scale for name, scale in scales.items()})
        samples.append((work, truth.time(work)))
    everything_at_one = Efficiency(**{**dict.fromkeys(rates, 0.9), "memory": 0.6})  # memory known: kept
    guess = truth.model_copy(
        update={"efficiency": everything_at_one, "launch_s": 1e-5, "branch_call_s": 1e-5, "decode_call_s": 1e-5}
    )
    fitted = calibrate(guess, samples, name="fitted", keep=("memory",))
    for name in ("matmul", "attention", "attention_backward", "recurrent"):
        assert getattr(fitted.efficiency, name) == pytest.approx(rates[name], rel=0.02), name
    for name in ("launch_s", "branch_call_s", "decode_call_s", "selection_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    assert fitted.efficiency.memory == 0.6  # kept: not fitted, its time taken off each sample before the fit
    assert fitted.measured_on == "fitted"


def test_step_time_table_names_every_phase_and_the_model():
    timed = step_time(PlanRequest(model="tiny-qwen3_5", context=4096, gpus=2, mode="exact"), PROFILES["h20"])
    table = timed.table()
    for phase in ("rollout", "capture", "replay", "walk"):
        assert phase in table
    assert "a model output" in table
    seconds = timed.phase_seconds()
    assert timed.training_seconds() == pytest.approx(sum(v for k, v in seconds.items() if k != "rollout"))
    assert 0 < timed.comm_share() < 1


def test_a_measured_profile_keeps_its_rates_and_takes_the_links_of_the_named_gpu():
    """``plan --time --profile``: the family's profile of a ``bench/gpu.py`` record (or of ``bench/timing.py``'s),
    every compute, memory and per-call rate as measured, the interconnect's and host link's from ``links``; a record
    without the family's profile says which families it has."""
    measured = PROFILES["h20"].model_copy(
        update={"name": "NVIDIA H100", "link_bandwidth": 1e9, "decode_call_s": 7e-6, "measured_on": "micro-benchmarks"}
    )
    record = {"setup": {"dense": {"profile": measured.model_dump()}, "mla": {"build_s": 1.0}}}
    profile = measured_profile(record, "dense", PROFILES["h200"])
    assert profile.link_bandwidth == PROFILES["h200"].link_bandwidth and profile.efficiency.link == 0.7
    assert profile.decode_call_s == 7e-6 and profile.peak_flops == measured.peak_flops
    assert profile.efficiency.attention == measured.efficiency.attention and profile.name == "NVIDIA H100"
    assert profile.measured_on == "micro-benchmarks; links: H200's"
    assert measured_profile({"profiles": {"dense": measured.model_dump()}}, "dense", PROFILES["h200"]) == profile
    with pytest.raises(ValueError, match=r"no profile measured for the hybrid family \(it has: dense\)"):
        measured_profile(record, "hybrid", PROFILES["h200"])


def test_fsdp_traffic_follows_the_schedule_of_each_mesh():
    """The model's accounting of FSDP2's traffic, per rank: every layer gathered per pass (the capture's one, two
    per branch, one per decode step of a rollout) and each branch's gradient reduce-scattered, at dp > 1 too (each
    dp rank for itself, ``parallel.lanes``: the bytes of the same gathers over every rank); HSDP shards over the cp
    ranks only (its gathers span fewer ranks, the replicas' gradient shards summed at the step's end); the engine
    without FSDP2 (``sharded=False``) moves only the context's messages; the replicated walk recomputes every chunk
    on every rank. (bench/distributed.py counts the real collectives' bytes.)"""
    config = TINY_PRESETS["llama"]()
    model = ModelWork.of(config, torch.float32)
    base = _request("llama").__dict__
    weights = model.weight_bytes

    def phases(sharded: bool = True, **mesh: int) -> dict[str, Work]:
        return {
            name: getattr(Schedule(PlanRequest(**{**base, **mesh}), model, sharded=sharded), name)()
            for name in ("capture", "replay", "walk", "rollout")
        }

    dp1 = phases(gpus=2, cp=2)
    plain = phases(sharded=False, gpus=2, cp=2)
    # the decoder layers once per wave of runs (two), the root once
    assert dp1["capture"].comm - plain["capture"].comm == pytest.approx(weights / 2 + model.layer_bytes / 2)
    layers, root = model.layer_bytes, model.root_bytes  # the root unit: whole for the step, its gradient reduced once
    per_branch = 2 * layers / 2 + layers / 2  # forward and backward gathers, the gradient reduce-scattered
    assert dp1["replay"].comm - plain["replay"].comm == pytest.approx(GROUP * per_branch + root / 2)
    dp2 = phases(gpus=2, dp=2, cp=1)  # (no cp messages)
    chunks = -(-(PROMPT - 1) // CHUNK)  # one cp rank captures chunk by chunk, each chunk gathering every layer
    assert dp2["capture"].comm == pytest.approx(chunks * layers / 2 + root / 2)
    assert dp2["replay"].comm == pytest.approx(GROUP * per_branch + root / 2)
    # sampling on the mesh: every decode step's attention partials merged over the cp ranks (each member's row per
    # attention layer), and its layers gathered a layer at a time
    merges = base["completion"] * GROUP * config.hidden_size * 4 * model.attention_layers() * (2 - 1)
    assert plain["rollout"].comm == pytest.approx(merges)
    assert dp1["rollout"].comm == pytest.approx(merges + base["completion"] * layers / 2 + root / 2)
    assert dp2["rollout"].comm == pytest.approx(base["completion"] * layers / 2 + root / 2)
    # HSDP over dp 2 x cp 2: a layer at a time over the 2 cp ranks, the replicas' gradient shards all-reduced once
    hsdp, flat = phases(gpus=4, dp=2, cp=2, hsdp=True), phases(gpus=4, dp=2, cp=2)
    # 4 ranks against 2 (the decoder layers gathered once per wave of runs)
    assert flat["capture"].comm - hsdp["capture"].comm == pytest.approx((weights + layers) * (3 / 4 - 1 / 2))
    assert hsdp["replay"].comm - dp1["replay"].comm == pytest.approx(2 * (2 - 1) / 2 * weights / 2)
    assert hsdp["rollout"].comm == dp1["rollout"].comm
    walk_replicated = Schedule(
        PlanRequest(**{**base, "gpus": 2, "cp": 2, "engine": EngineConfig(chunk_size=CHUNK, wavefront_walk=False)}),
        model,
    ).walk()
    assert walk_replicated.matmul > dp1["walk"].matmul  # every rank recomputes every chunk


def test_offload_copies_the_shards_in_for_each_gather_and_their_gradients_out():
    """With ``offload`` (FSDP2's CPU offload) every gather first copies the rank's fp32 master shards to the device
    and every reduction copies the gradient shards back: the capture's one pass, a branch's two gathers and its
    reduction, the walk's recomputation (``walk_gather_order``) and per wave of runs its backward and its
    reduction, a decode step's pass —
    of the decoder layers; the root unit once per block — over the host link, at its own rate; the collectives
    themselves are unchanged."""
    config = TINY_PRESETS["llama"]()
    model = ModelWork.of(config, torch.bfloat16)
    base = {**_request("llama").__dict__, "dtype": torch.bfloat16, "gpus": 2, "cp": 2}

    def shard(nbytes: float) -> float:  # the rank's half, in fp32 masters (bf16 compute)
        return nbytes / 2 * 4 / 2

    layers, root = shard(model.layer_bytes), shard(model.root_bytes)

    def phases(**options: bool) -> dict[str, Work]:
        schedule = Schedule(PlanRequest(**{**base, **options}), model)
        return {name: getattr(schedule, name)() for name in ("capture", "replay", "walk", "rollout")}

    kept, moved = phases(), phases(offload=True)
    expected = {  # (the root unit whole for a block: gathered once, its gradient reduced once)
        "capture": 2 * layers + root,  # (a balanced cut's two waves of runs)
        "replay": GROUP * 3 * layers + root,
        # (per wave of runs a gather for the backward and a reduction; one segment of both layers, whose
        # recomputation gathers the layer below its top: half the layers' bytes)
        "walk": 4.5 * layers,
        "rollout": COMPLETION * layers + root,
    }
    for name, host in expected.items():
        assert kept[name].host == 0 and moved[name].host == pytest.approx(host), name
        assert moved[name].comm == kept[name].comm, name
    profile = PROFILES["h200"]
    assert profile.seconds(moved["replay"])["host"] == pytest.approx(expected["replay"] / profile.host_bandwidth)


def test_reductions_run_in_the_master_dtype_and_the_reference_copies_its_compute_dtype_shards():
    """bf16 compute over fp32 masters: every gradient reduction (a branch's layers, the root's at the step's end)
    moves fp32, twice the bytes of bf16 masters; with offload the KL reference's scoring copies in its own shards,
    kept in the compute dtype (frozen: no master weights), half the bytes of the policy's gathers."""
    model = ModelWork.of(TINY_PRESETS["llama"](), torch.bfloat16)
    base = {**_request("llama", mode="detached").__dict__, "dtype": torch.bfloat16, "gpus": 2, "cp": 2}

    def schedule(**options: object) -> Schedule:
        return Schedule(PlanRequest(**{**base, **options}), model)

    fp32, bf16 = schedule(), schedule(mixed_precision=False)
    reduced = GROUP * model.layer_bytes + model.root_bytes  # in bf16; over 2 ranks a reduce-scatter moves half
    assert fp32.replay().comm - bf16.replay().comm == pytest.approx(reduced / 2)
    offloaded = schedule(offload=True, beta=0.1)
    assert offloaded.scoring().host == pytest.approx(GROUP * model.layer_bytes / 2)  # its bf16 shard, per member
    # fp32 masters; a balanced capture gathers the layers once per wave of runs (twice), the root once
    assert offloaded.capture().host == pytest.approx((2 * model.layer_bytes + model.root_bytes) * 2 / 2)


def test_a_walk_chunk_by_chunk_gathers_and_reduces_every_layer_for_each_chunk():
    """One cp rank's walk, and every rank's replicated walk, recompute the prompt a chunk at a time, each chunk's
    layers gathered for its forward and again for its backward, their gradient reduced as its backward ends
    (``LayerGather.run``); the wavefront walk does that once per layer. The capture's rows aside (state gradient),
    the walks' FSDP traffic is per chunk and per walk."""
    model = ModelWork.of(TINY_PRESETS["llama"](), torch.float32)
    base = _request("llama").__dict__
    chunks = -(-(PROMPT - 1) // CHUNK)
    per_pass = 2 * model.layer_bytes / 2 + model.layer_bytes / 2  # two gathers and a reduce-scatter over 2 ranks

    def walk(**options: object) -> Work:
        return Schedule(PlanRequest(**{**base, "gpus": 2, **options}), model).walk()

    def unsharded(**options: object) -> Work:
        return Schedule(PlanRequest(**{**base, "gpus": 2, **options}), model, sharded=False).walk()

    assert walk(dp=2, cp=1).comm == pytest.approx(chunks * per_pass)
    replicated = EngineConfig(chunk_size=CHUNK, wavefront_walk=False)
    assert walk(cp=2, engine=replicated).comm - unsharded(cp=2, engine=replicated).comm == pytest.approx(
        chunks * per_pass - model.weight_bytes * 2 * (2 - 1) / 2  # (the engine alone all-reduces the gradient once)
    )
    # the wavefront walk of a balanced cut: per wave of runs (two) each layer gathered for the backward and its
    # gradient reduced, and the recomputation of the one segment (both layers) gathering the layer below its top
    wavefront = 2.5 * model.layer_bytes / 2 + 2 * model.layer_bytes / 2
    assert walk(cp=2).comm - unsharded(cp=2).comm == pytest.approx(wavefront - model.weight_bytes * 2 * (2 - 1) / 2)
    offloaded = walk(dp=2, cp=1, offload=True)
    assert offloaded.host == pytest.approx(chunks * 3 * model.layer_bytes / 2)  # each shard in twice, out once
    # a hybrid keeping its recurrent states every 2nd chunk: the walk recomputes the chunk before each kept one
    # (no graph), which gathers every layer once more
    hybrid = ModelWork.of(TINY_PRESETS["qwen3_5"](), torch.float32)
    spaced = EngineConfig(chunk_size=CHUNK, checkpoint_every=2)
    every = Schedule(PlanRequest(**{**base, "gpus": 2, "dp": 2, "cp": 1}), hybrid).walk()
    sparse = Schedule(PlanRequest(**{**base, "gpus": 2, "dp": 2, "cp": 1, "engine": spaced}), hybrid).walk()
    recomputed = chunks - 1 - 1  # chunks 0 and 1 before the last; the states after chunk 1 kept
    assert sparse.comm - every.comm == pytest.approx(recomputed * hybrid.layer_bytes / 2)


def test_the_optimizer_steps_the_ranks_shard_in_device_memory_or_on_the_host():
    """AdamW's step reads each master parameter, its gradient and two moments and writes three of them: on the
    device (``memory``), or with offload in host memory at the process's own rate; no optimizer, no phase."""
    model = ModelWork.of(TINY_PRESETS["llama"](), torch.bfloat16)
    base = {**_request("llama", mode="detached").__dict__, "dtype": torch.bfloat16, "gpus": 2, "cp": 2}
    parameters = model.weight_bytes / 2 / 2  # bf16 weights, the rank's half

    def phases(**options: object) -> dict[str, Work]:
        return step_work(PlanRequest(**{**base, **options}), model, rollout=False).phases

    assert phases()["optimizer"] == Work(memory=7 * parameters * 4)  # fp32 masters
    assert phases(mixed_precision=False)["optimizer"] == Work(memory=7 * parameters * 2)
    host = phases(offload=True)["optimizer"]
    assert host == Work(host_step=7 * parameters * 4)
    profile = PROFILES["h200"]
    assert profile.time(host) == pytest.approx(7 * parameters * 4 / profile.host_step_bandwidth)
    assert "optimizer" not in phases(optimizer="none")


def test_the_walk_recomputes_the_recurrent_states_between_checkpoints():
    """A hybrid whose recurrent states are kept every third chunk: exact mode's walk recomputes the others' state
    entries once each, as torch counts on the real run (a detached step subtracted)."""
    config = TINY_PRESETS["qwen3_5"]()
    torch.manual_seed(0)
    model = build_model(config, dtype=torch.float32)
    engine_config = EngineConfig(chunk_size=16, checkpoint_every=3)
    engine = Engine(model, engine_config)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (PROMPT,), generator=gen)
    completions = [
        torch.cat([torch.tensor([k]), torch.randint(0, config.vocab_size, (COMPLETION - 1,))]) for k in range(2)
    ]
    counted = {}
    for mode in ("detached", "exact"):
        model.zero_grad(set_to_none=True)
        counted[mode] = _counted(lambda mode=mode: grpo_backward(engine, prompt, completions, [0.0, 1.0], mode))[0]
    request = PlanRequest(**{**_request("qwen3_5").__dict__, "group": 2, "engine": engine_config})
    walk = Schedule(request, ModelWork.of(config, torch.float32)).walk()
    segments = Schedule(request, ModelWork.of(config, torch.float32))._recurrent_segments()
    assert segments.flops > 0
    assert counted["exact"] - counted["detached"] == pytest.approx(walk.flops, rel=0.02)


@pytest.fixture(scope="module")
def each_ranks_experts():
    """glm_moe_dsa in one process, torch's counts of a detached and an exact step with the routed experts as one
    process computes them; as the 2 ranks of expert parallelism do, each rank's experts a node of its own
    (``ExpertShard`` without a group: nothing all-reduced), their shares added; and with none (zeros that keep the
    routing weights' graph); beside the model's phases at a rank's share of the experts and at all of them."""
    config, model, engine, prompt, completions = _step_inputs("glm_moe_dsa")
    per_rank = config.n_routed_experts // 2

    def ranks_added(moe: MoE) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        shards = [ExpertShard(moe, None, None, rank * per_rank, per_rank) for rank in range(2)]
        return lambda x, top_idx, weights: sum(shard(x, top_idx, weights) for shard in shards)

    def none(x: Tensor, top_idx: Tensor, weights: Tensor) -> Tensor:
        return x * (weights.sum(dim=-1, keepdim=True) * 0)

    counted: dict[str, dict[str, float]] = {"one process": {}, "ranks": {}, "none": {}}
    for how, routed in counted.items():
        for layer in engine.adapter.layers:
            if isinstance(layer.mlp, MoE):
                hooks = {"one process": layer.mlp.local, "ranks": ranks_added(layer.mlp), "none": none}
                layer.mlp.routed = hooks[how]
        for mode in ("detached", "exact"):
            model.zero_grad(set_to_none=True)
            routed[mode] = _counted(lambda mode=mode: grpo_backward(engine, prompt, completions, [0, 1, 0.5], mode))[0]
    whole = ModelWork.of(config, torch.float32)
    phases = {
        experts: step_work(_request("glm_moe_dsa"), replace(whole, experts=experts), rollout=False).phases
        for experts in (0.5, 1.0)
    }
    return counted, phases


@pytest.mark.parametrize("step", ["detached", "exact"])
def test_a_ranks_experts_are_its_share_of_the_routed_work(each_ranks_experts, step):
    """Expert parallelism: a rank computes its own experts on every token, and their backward recomputes that
    forward (the node keeps no graph). With both ranks' nodes in one process torch counts both ranks' expert work
    beside the rest of the step (the count without experts: no other FLOPs depend on the routing); routing is not
    even over the ranks, but a rank's mean is half of both, so a rank does what one process does less that half
    — as the model counts at half the experts."""
    counted, phases = each_ranks_experts
    rest = counted["none"][step]
    rank = rest + (counted["ranks"][step] - rest) / 2
    less = _modelled(phases[1.0], STEPS[step]).flops - _modelled(phases[0.5], STEPS[step]).flops
    assert counted["one process"][step] - rank == pytest.approx(less, rel=1e-3), step  # (FLOPs per slot alike)


def test_expert_parallelism_replicates_every_extend_and_sums_the_experts_shares() -> None:
    """Under expert parallelism every extend is replicated: each rank computes every chunk (attention to the
    positions it holds, the partials merged), its own experts' share of the routed work, and all-reduces their
    outputs per MoE call (their gradients in backward); a gather leaves the experts out, and offloaded experts are
    copied in for every pass (each MoE call) and their gradient out per backward pass."""
    model = ModelWork.of(TINY_PRESETS["glm_moe_dsa"](), torch.float32)
    config, routed = model.config, model.routed
    engine = EngineConfig(chunk_size=CHUNK, sharded_extends=False)
    base = dict(model="tiny-glm_moe_dsa", context=PROMPT, group=GROUP, completion=COMPLETION, gpus=2, cp=2)
    base |= dict(dtype=torch.float32, engine=engine, mode="exact", mixed_precision=False)

    def schedule(**options: object) -> Schedule:
        return Schedule(PlanRequest(**{**base, **options}), model)

    ep, replicated = schedule(expert_parallel=True), schedule()
    assert ep.model.experts == 0.5 and replicated.model.experts == 1.0
    captured, chunks = PROMPT - 1, -(-(PROMPT - 1) // CHUNK)
    whole = model.chunked(0, captured, CHUNK, entries_only=True)
    capture = ep.capture()
    assert capture.attention == pytest.approx(whole.attention / 2)  # the rank's positions only
    flops, _ = model._routed(entries_only=True)
    assert replicated.capture().matmul - capture.matmul == pytest.approx(flops / 2 * captured)
    # comm: the partials merged, the experts' outputs all-reduced per MoE call, every chunk gathering every layer
    # without the experts
    calls = len(routed.layers) - routed.last_layer
    sums = 2 * (2 - 1) / 2 * calls * captured * config.hidden_size * 4
    gathers = chunks * (model.layer_bytes - routed.weight_bytes) / 2 + model.root_bytes / 2
    merges = captured * config.hidden_size * 4 * model.attention_layers()
    assert capture.comm == pytest.approx(merges + sums + gathers)
    assert replicated.capture().comm == pytest.approx(merges + chunks * model.layer_bytes / 2 + model.root_bytes / 2)
    assert capture.host == 0
    # offloaded: the rank's experts (fp32 shards) copied in for every chunk's pass; a branch's backward sends their
    # gradient out once
    offloaded = schedule(expert_parallel=True, offload=True)
    experts_in = chunks * routed.weight_bytes / 2
    assert offloaded.capture().host == pytest.approx(experts_in + gathers)
    replay = offloaded.replay().host - schedule(expert_parallel=True).replay().host
    layer_shards = (model.layer_bytes - routed.weight_bytes) / 2
    per_member = 2 * (layer_shards + routed.weight_bytes / 2) + layer_shards + routed.weight_bytes / 2
    assert replay == pytest.approx(GROUP * per_member + model.root_bytes / 2)
    # decoding reads the weights but the experts once, and of the experts the rank's share of those chosen
    dense = model.weight_bytes - routed.weight_bytes
    chosen = min(routed.weight_bytes, (model.active_weight_bytes - dense) * GROUP)
    assert model.decoded_weight_bytes(GROUP) == pytest.approx(dense + chosen)
    assert ep.model.decoded_weight_bytes(GROUP) == pytest.approx(dense + chosen / 2)
    assert step_time(PlanRequest(**{**base, "expert_parallel": True}), PROFILES["h200"]).training_seconds() > 0


def test_dispatched_experts_shard_the_capture_and_send_each_token_to_its_experts() -> None:
    """Expert parallelism with sharded extends (``parallel.expert_dispatch``): the capture is the sharded one (a
    rank its own chunks, gathered once per wave of runs without the experts), its experts serving every rank's
    tokens (as much routed work as its own tokens' at full share, routing even); each MoE call sends a token's row
    to each of its experts and the output back, half of them to the other rank at cp = 2; offloaded experts are
    copied in as often as a replicated capture copies them (once per chunk)."""
    model = ModelWork.of(TINY_PRESETS["glm_moe_dsa"](), torch.float32)
    config, routed = model.config, model.routed
    base = dict(model="tiny-glm_moe_dsa", context=PROMPT, group=GROUP, completion=COMPLETION, gpus=2, cp=2)
    base |= dict(dtype=torch.float32, mode="detached", mixed_precision=False, expert_parallel=True)
    base |= dict(engine=EngineConfig(chunk_size=CHUNK))

    def schedule(**options: object) -> Schedule:
        return Schedule(PlanRequest(**{**base, **options}), model)

    dispatched, replicated = schedule(expert_dispatch=True), schedule()
    plain = schedule(expert_parallel=False)
    assert dispatched.request.dispatched and not replicated.request.dispatched
    capture, sharded = dispatched.capture(), plain.capture()
    # a rank's experts serve every rank's tokens: as much routed work as its own tokens' whole (routing even), the
    # non-expert work of its own tokens only (replicated, every rank repeats every token's); the rounds hold the
    # ranks in lockstep, each step as long as its busiest rank's (the last rank's merged run, two parts a cell)
    assert sharded.flops < capture.flops < 1.5 * sharded.flops
    assert replicated.capture().matmul > capture.matmul
    mine = max(plain.rank_captures(True), key=lambda share: share.work.flops).positions
    calls = len(routed.layers) - routed.last_layer
    rows = 2 * mine * config.num_experts_per_tok * config.hidden_size * 4 / 2 * calls
    experts = routed.weight_bytes / 2  # (never gathered: each wave's gather of a layer leaves them out)
    assert capture.comm - sharded.comm == pytest.approx(rows - 2 * experts)
    chunks = -(-(PROMPT - 1) // CHUNK)
    offloaded = schedule(expert_dispatch=True, offload=True)
    layers_and_root = (2 * (model.layer_bytes - routed.weight_bytes) + model.root_bytes) / 2
    assert offloaded.capture().host == pytest.approx(layers_and_root + chunks * routed.weight_bytes / 2)


@pytest.fixture(scope="module")
def published_hybrid() -> ModelWork:
    return ModelWork.of(load_config("qwen3.6-27b"), torch.bfloat16)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_balanced_cut_evens_every_ranks_capture_work_and_state(published_hybrid: ModelWork, cp: int) -> None:
    """The schedule's own count at Qwen3.6-27B's layout and 2.1M positions, where attention dominates: cut in rank
    order the last rank's capture is 1.44-1.78x the mean (its queries attend to everything before them); the
    balanced cut (rank r computing the r-th and the (2cp - 1 - r)-th of 2cp parts) evens work and state to 10 %."""
    schedule = Schedule(
        PlanRequest(model="qwen3.6-27b", context=2_100_000, gpus=cp, dtype=torch.bfloat16), published_hybrid
    )
    work, state = schedule.capture_balance(balanced=True)
    assert work <= 1.1 and state <= 1.1
    in_order, in_order_state = schedule.capture_balance(balanced=False)
    assert in_order > 1.4 and in_order_state <= 1.1
    # the time model charges the capture's slowest rank: the balanced one unless its layer inputs are kept
    slowest = max(share.work.flops for share in schedule.rank_captures(balanced=True))
    assert schedule.capture().flops == pytest.approx(slowest)


@pytest.mark.parametrize("step", ["detached", "exact"])
def test_a_lora_policys_flops_match_torchs_count(step):
    """A LoRA policy: its adapters' matmuls added, a frozen weight's backward one product (its input's gradient),
    the frozen LM head's three: within 5 % of torch's count of the real step (the model leaves the first layer's
    input projections their input gradient, which autograd skips under frozen embeddings: 4 % of this 2-layer model's
    exact step, a share of about 1 / (3 x layers)); counted as a full model's, the step would be 14-17 % over."""
    from longstraw_agents.models.lora import LoraSpec, apply_lora

    lora = LoraSpec(r=4, target_modules="all-linear")
    config, model, engine, prompt, completions = _step_inputs("llama")
    engine = Engine(apply_lora(model, lora), EngineConfig(chunk_size=CHUNK))
    counted, _ = _counted(lambda: grpo_backward(engine, prompt, completions, [0.0, 1.0, 0.5], step))
    request = replace(_request("llama", step), lora=lora)
    phases = step_work(request, ModelWork.of(config, torch.float32, lora), rollout=False).phases
    assert counted == pytest.approx(_modelled(phases, STEPS[step]).flops, rel=0.05)
    full = step_work(_request("llama", step), ModelWork.of(config, torch.float32), rollout=False).phases
    assert _modelled(full, STEPS[step]).flops > 1.1 * counted
