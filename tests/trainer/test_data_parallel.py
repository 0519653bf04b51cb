"""GRPOTrainer over a ``(dp, cp)`` mesh on gloo CPU processes: a step where each dp rank holds its own groups (and
the cp ranks of one dp rank the same groups, their prompt state sharded) ends with every rank holding the parameters
of one process given all the groups (fp64)."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import peft  # noqa: F401  (imported before the ranks fork, which then need not import it each)
import pytest
import torch
import torch.multiprocessing as mp
from data_parallel_worker import make_trainer, run, step_groups
from grpo_reference import relative_l2

from longstraw_agents.engine import wavefront
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.checkpoint import load_full_model
from longstraw_agents.parallel.fsdp import prefetch_window

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(tmp_path: Path, world: int, **spec) -> list[dict]:
    # fork: the children skip re-importing torch (~10 s on 2 busy cores); spawn once CUDA is initialised here
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.start_processes(run, args=(world, _free_port(), str(tmp_path), spec), nprocs=world, start_method=start_method)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _one_process(
    normalization: str, family: str = "llama", beta: float = 0.0, lora: bool = False
) -> tuple[dict[str, torch.Tensor], float]:
    """Parameters after the step and the gradient norm it reported (before clipping to 1)."""
    trainer = make_trainer(normalization, family=family, beta=beta, lora=lora)
    metrics = trainer.train_step(step_groups(trainer))
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}, metrics.grad_norm


@pytest.mark.parametrize(
    ("dp", "cp", "normalization"),
    [
        pytest.param(2, 2, "batch", id="dp2xcp2-batch"),
        pytest.param(2, 1, "group", id="dp2xcp1-group"),
    ],
)
def test_a_step_on_the_mesh_equals_one_process_holding_every_group(tmp_path, dp, cp, normalization):
    """Every collective of the step runs on the mesh's dp or cp group, never on the default world group by
    accident (over all 4 processes each group would count twice — invisible in the result, as the gradient sums and
    the batch pool would both double, hence the check on the calls themselves)."""
    ranks = _spawn(tmp_path, dp * cp, dp=dp, cp=cp, normalization=normalization)
    expected, grad_norm = _one_process(normalization)
    assert grad_norm > 1.0  # clipping is part of what is compared
    assert sorted(r["dp_rank"] for r in ranks) == sorted(list(range(dp)) * cp)
    for rank, result in enumerate(ranks):
        assert relative_l2(result["params"], expected) <= 1e-10, rank
        assert result["stray_collectives"] == [], rank
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-10), rank


@pytest.mark.parametrize(
    ("family", "normalization"), [("llama", "group"), ("qwen3_5", "batch"), ("glm_moe_dsa", "group")]
)
def test_fsdp2_step_equals_one_process_and_each_rank_holds_half_of_each_parameter(tmp_path, family, normalization):
    """FSDP2 over dp=2: the engine bypasses FSDP's hooks, so each dp rank gathers a layer at a time and reduces its
    gradients itself, served by the other (parallel.lanes; the two dp ranks' groups differ: 2 and 1); AdamW steps
    each rank's shard. After the step the full parameters equal one process's (fp64), and each rank stores half of
    every parameter (dim 0 split)."""
    ranks = _spawn(tmp_path, 2, dp=2, cp=1, normalization=normalization, fsdp=True, family=family)
    expected, grad_norm = _one_process(normalization, family)
    assert grad_norm > 1.0  # clipping is part of what is compared
    for rank, result in enumerate(ranks):
        assert relative_l2(result["params"], expected) <= 1e-10, rank
        assert result["stray_collectives"] == [], rank
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-10), rank
    for name, (_, shape) in ranks[0]["sizes"].items():
        held = [r["sizes"][name][0] for r in ranks]
        assert held == [n * math.prod(shape[1:]) for n in held_rows(shape, 2)], name


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
def test_a_checkpoint_on_the_mesh_resumes_bit_exactly(tmp_path, fsdp):
    """Saved once by every rank together through DCP (FSDP2: each rank's shards; replicated: one copy of the whole),
    loaded into fresh trainers: one more step gives bit-identical parameters on every rank."""
    ranks = _spawn(tmp_path, 2, dp=2, cp=1, normalization="group", fsdp=fsdp, resume=True)
    for rank, result in enumerate(ranks):
        resumed = result["resumed"]
        assert all(resumed["equal"]) and resumed["counters"] == (1, 1), rank
    files = ranks[0]["resumed"]["files"]
    assert "trainer_state.json" in files and {"random_states_0.pkl", "random_states_1.pkl"} <= set(files)
    assert "sharded/.metadata" in files and "model.safetensors" not in files
    whole = tiny_model("llama", dtype=torch.float64, seed=1)  # other weights, all overwritten
    load_full_model(whole, tmp_path / "checkpoint")  # one process, no process group: the export's way in
    saved = ranks[0]["resumed"]["saved"]
    assert all(torch.equal(p, saved[name]) for name, p in whole.named_parameters())


def held_rows(shape: tuple[int, ...], ranks: int) -> list[int]:
    """Rows of dim 0 each of ``ranks`` ranks holds under FSDP2's even split (torch.chunk's: the last may be short)."""
    size = -(-shape[0] // ranks)
    return [max(0, min(size, shape[0] - r * size)) for r in range(ranks)]


@pytest.mark.parametrize(
    ("dp", "cp", "bucket", "hsdp", "offload"),
    [
        (2, 2, 4096, False, False),  # (with a KL term)
        (1, 2, None, False, False),
        (2, 2, None, True, False),
        (1, 2, None, False, True),
        (2, 2, None, True, True),
        (1, 4, None, False, False),
    ],
    ids=["dp2xcp2-4KiB-buckets-kl", "dp1xcp2", "dp2xcp2-hsdp", "dp1xcp2-offload", "dp2xcp2-hsdp-offload", "dp1xcp4"],
)
def test_fsdp2_over_every_rank_with_context_parallel_equals_one_process(
    tmp_path, monkeypatch, dp, cp, bucket, hsdp, offload
):
    """FSDP2 over the flattened dp x cp mesh on a hybrid (dp = 1 included, the published run's shape): the cp ranks
    of a dp rank each end the backward with the group's whole gradient (exact mode's wavefront walk sums it over cp),
    which the reduce-scatter over every rank counts once; the step equals one process's, and each rank stores
    1/(dp·cp) of every parameter. At dp = 1 the engine gathers a decoder layer at a time (``LayerGather``): no rank
    ever holds more than the prefetch window (cp layers) plus the one it computes, of the model's 4. At dp 2 the
    walk's sum over cp runs in 4 KiB buckets — many, and parameters larger than one alone: every path of the
    bucketing, whose default 25 MiB holds a tiny model in one (the forked ranks inherit the setting). With HSDP the
    dp ranks (2 groups and 1) replicate the model, each sharded over its cp ranks, which gather a layer at a time
    too; the replicas' gradients are summed once at the step's end. With offload (FSDP2's CPU offload policy) the
    shards, their gradients and AdamW's state are the host's and AdamW steps there: the same step. At dp 2 sharded
    over all four, with a KL term (beta 0.1): the reference is sharded as the policy and each dp rank scores it on
    its own schedule (``parallel.lanes``: the reference's communicators apart from the policy's, both served during
    the step)."""
    if bucket is not None:
        monkeypatch.setattr(wavefront, "GRADIENT_BUCKET_BYTES", bucket)
    beta = 0.1 if dp > 1 and not hsdp else 0.0
    spec = {"normalization": "group", "fsdp": True, "family": "qwen3_5", "hsdp": hsdp, "offload": offload}
    ranks = _spawn(tmp_path, dp * cp, dp=dp, cp=cp, beta=beta, **spec)
    expected, grad_norm = _one_process("group", "qwen3_5", beta)
    for rank, result in enumerate(ranks):
        assert relative_l2(result["params"], expected) <= 1e-10, rank
        assert result["stray_collectives"] == [], rank
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-10), rank
        assert result["offloaded"] == offload, rank
        # a layer at a time (what the planner counts: plan/parameters.py, _whole_at_once); at dp 2 without
        # HSDP each dp rank on a communicator of its own (``parallel.lanes``)
        # (a capture: one per cell, gathered once per wave of runs; the walk: the prefetch window + 1, balanced
        # under FSDP2 each wave's gathers started as they fall due and a segment's recomputation one at a time)
        assert 1 <= result["most_gathered"] <= min(prefetch_window(cp) + 1, 4), rank
    shards = cp if hsdp else dp * cp  # (ranks are numbered cp-major: rank = dp_rank * cp + cp_rank)
    for name, (_, shape) in ranks[0]["sizes"].items():
        held = [r["sizes"][name][0] for r in ranks]
        assert held == [n * math.prod(shape[1:]) for n in held_rows(shape, shards)] * (dp * cp // shards), name


@pytest.mark.parametrize(
    ("dp", "cp", "hsdp", "mode", "beta", "first_half", "dispatched", "offload"),
    [
        (1, 2, False, "exact", 0.1, False, False, True),
        (2, 2, True, "detached", 0.0, False, False, False),
        (1, 2, False, "detached", 0.0, True, True, False),
        (1, 2, False, "exact", 0.1, False, True, False),
        (1, 4, False, "exact", 0.1, False, True, False),
    ],
    ids=[
        "dp1xcp2-exact-kl-offload",
        "dp2xcp2-hsdp-detached",
        "dp1xcp2-detached-one-ranks-experts-only-dispatched",
        "dp1xcp2-exact-kl-dispatched",
        "dp1xcp4-exact-kl-dispatched",
    ],
)
def test_expert_parallel_equals_one_process_and_each_cp_rank_holds_its_experts(
    tmp_path, dp, cp, hsdp, mode, beta, first_half, dispatched, offload
):
    """Expert parallelism (parallel.experts) on the MoE family: each cp rank holds 4 of each MoE layer's 8 experts
    whole (its master weights, gradient and AdamW state), computes them on every token (each extend replicated)
    and never gathers the others'; the shares are added over the cp ranks. Capture, branch replays, exact mode's
    walk (replicated) and the KL reference's scoring (its experts held the same way) give one process's step, and a
    layer is still gathered at a time for the rest of its weights. With HSDP the dp replicas sum their experts'
    gradients as every other shard's. ``first_half``: a router bias sends every token to the first cp rank's
    experts, so the other's share is zeros and its experts get a zero gradient (as one process's stacked weights
    do: AdamW's weight decay still moves them). ``offload``: the shards, experts included, on the host (each MoE call
    copies the rank's in). ``dispatched``: the prompt's capture sharded (each rank its own
    chunks), each MoE call a round of all-to-alls sending every token to its experts' ranks and back; exact mode
    then walks replicated."""
    spec = {"normalization": "group", "fsdp": True, "family": "glm_moe_dsa", "hsdp": hsdp, "mode": mode}
    spec |= {"routed_to_first_half": first_half, "dispatched": dispatched, "offload": offload}
    ranks = _spawn(tmp_path, dp * cp, dp=dp, cp=cp, beta=beta, expert_parallel=True, **spec)
    one = make_trainer("group", family="glm_moe_dsa", beta=beta, mode=mode, routed_to_first_half=first_half)
    grad_norm = one.train_step(step_groups(one)).grad_norm
    expected = {name: p.detach().clone() for name, p in one.model.named_parameters()}
    for rank, result in enumerate(ranks):
        assert relative_l2(result["params"], expected) <= 1e-10, rank
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-10), rank
        assert result["stray_collectives"] == [], rank
        assert result["offloaded"] == offload, rank
        # replicated: a layer at a time; dispatched: no more than a balanced capture's cp layers whole (fewer in a
        # prompt of a few chunks), never a layer held across the lag between a rank's runs
        assert 1 <= result["most_gathered"] <= (cp if dispatched else 1), rank
        assert (result["expert_units"], result["experts_unsharded"]) == (2, 0), rank  # never gathered
        assert result["routed"] == ["ExpertShard"], rank
        assert (result["expert_rounds"] > 0) == dispatched, rank
    experts = {name: shape for name, (_, shape) in ranks[0]["sizes"].items() if ".mlp.experts." in name}
    assert len(experts) == 4  # two MoE layers' stacked gate/up and down projections
    for name, shape in experts.items():
        held = [r["sizes"][name][0] for r in ranks]
        assert held == [shape[0] // cp * math.prod(shape[1:])] * (dp * cp), name  # whole experts, 8 / cp each


@pytest.mark.parametrize(
    ("dp", "cp", "experts"), [(2, 1, False), (1, 2, False), (1, 2, True)], ids=["dp2", "dp1xcp2", "dp1xcp2-experts"]
)
def test_fsdp2_mixed_precision_equals_one_process_with_the_same_policy(tmp_path, dp, cp, experts):
    """FSDP2's mixed precision (fp64 master shards, gathered in fp32 for compute, gradients reduced in fp64) against
    one process with a compute copy: the same per-group fp32 arithmetic, gradients summed in fp64 on both sides, so
    they agree to fp32's rounding (cp merges attention across ranks in another order; AdamW's first step divides
    each gradient by its own size, so the gradient norm is what shows a scale), and differ from fp64 compute by more.
    AdamW steps fp64 shards with fp64 moments on every rank. ``experts``: the MoE family under expert parallelism,
    each rank's experts cast to fp32 for its MoE calls and their gradient added into the fp64 shards."""
    family = "glm_moe_dsa" if experts else "llama"
    ranks = _spawn(
        tmp_path, dp * cp, dp=dp, cp=cp, normalization="group", fsdp=True, compute_dtype="float32", family=family,
        expert_parallel=experts,
    )  # fmt: skip
    one = make_trainer("group", compute_dtype="float32", family=family)
    grad_norm = one.train_step(step_groups(one)).grad_norm
    expected = {name: p.detach() for name, p in one.model.named_parameters()}
    in_fp64, _ = _one_process("group", family)
    for rank, result in enumerate(ranks):
        assert relative_l2(result["params"], expected) <= 1e-5, rank
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), rank
        assert relative_l2(result["params"], in_fp64) > 1e-9, rank
        assert result["stepped_dtypes"] == ["torch.float64"], rank
    assert one.engine.model.dtype == torch.float32 and one.model.dtype == torch.float64


def test_a_checkpoint_resumes_on_another_mesh(tmp_path):
    """A dp=2 FSDP2 checkpoint (each rank's shards, through DCP) resumes at dp=1 x cp=2 with FSDP2 over both ranks
    and in one process without a mesh: DCP reshards the parameters and AdamW's state, so the next step gives what one
    process taking both steps gives (fp64; the meshes sum in other orders, hence not bit for bit)."""
    checkpoint = tmp_path / "checkpoint"
    _spawn(tmp_path / "dp2", 2, dp=2, cp=1, normalization="group", fsdp=True, save=str(checkpoint))
    cp2 = _spawn(tmp_path / "cp2", 2, dp=1, cp=2, normalization="group", fsdp=True, load=str(checkpoint))
    alone = make_trainer("group")
    alone.load_checkpoint(checkpoint)
    alone.train_step(step_groups(alone))
    reference = make_trainer("group")
    for _ in range(2):
        reference.train_step(step_groups(reference))
    expected = {name: p.detach().clone() for name, p in reference.model.named_parameters()}
    assert relative_l2({n: p.detach() for n, p in alone.model.named_parameters()}, expected) <= 1e-10
    assert (alone.step_count, alone.policy_version) == (2, 2)
    for rank, result in enumerate(cp2):
        assert relative_l2(result["params"], expected) <= 1e-10, rank
        assert result["counters"] == (2, 2), rank


@pytest.mark.parametrize(("family", "dp", "cp"), [("llama", 1, 2), ("glm_moe_dsa", 2, 1)])
def test_a_lora_policy_sharded_with_fsdp2_equals_one_process(tmp_path, family, dp, cp):
    """LoRA adapters (every linear layer; on glm_moe_dsa the MLA projections, the router and the routed experts too)
    on a model FSDP2 shards over every rank: the frozen weights stay sharded and are gathered a layer at a time as a
    fully trained model's (exact mode's wavefront walk at cp 2; each dp rank's lanes at dp 2), only the adapters'
    gradients are reduced and only they get AdamW state; the step equals one process's (fp64), the frozen weights
    unchanged."""
    ranks = _spawn(tmp_path, dp * cp, dp=dp, cp=cp, normalization="group", fsdp=True, family=family, lora=True)
    expected, _ = _one_process("group", family, lora=True)
    initial = make_trainer("group", family=family, lora=True).model
    frozen = {name for name, p in initial.named_parameters() if not p.requires_grad}
    for rank, result in enumerate(ranks):
        assert relative_l2(result["params"], expected) <= 1e-10, rank
        assert result["stray_collectives"] == [], rank
        assert all(torch.equal(result["params"][n], initial.get_parameter(n)) for n in frozen), rank
        assert result["optimized"] and all(".lora_" in name for name in result["optimized"]), rank
        assert 1 <= result["most_gathered"] <= min(prefetch_window(cp) + 1, 4), rank
    adapters = [name for name in ranks[0]["sizes"] if ".lora_" in name]
    for name in adapters:  # the adapters sharded too (dim 0 over every rank)
        held, shape = [r["sizes"][name][0] for r in ranks], ranks[0]["sizes"][name][1]
        assert held == [n * math.prod(shape[1:]) for n in held_rows(shape, dp * cp)], name
