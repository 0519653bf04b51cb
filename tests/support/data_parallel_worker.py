"""One rank of the data-parallel trainer tests (tests/trainer/test_data_parallel.py): a ``(dp, cp)`` mesh, the dp
rank's share of one step's groups, one ``train_step``; the rank's parameters (full tensors) and what it holds of
them are written to ``out_dir/rank{r}.pt`` for the test process to compare with one process holding every group."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.lora import LoraSpec, apply_lora
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import ContextParallel, ParallelMesh, parallelize
from longstraw_agents.parallel.discipline import record_from_env
from longstraw_agents.parallel.experts import expert_units
from longstraw_agents.parallel.fsdp import offloaded
from longstraw_agents.parallel.lanes import LaneGather
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer
from longstraw_agents.trainer.group import Group

PROMPT_LEN, CHUNK, G, NUM_GROUPS = 20, 8, 3, 3


def make_trainer(
    normalization: str,
    accelerator: Accelerator | None = None,
    mesh: ParallelMesh | None = None,
    fsdp: bool = False,
    family: str = "llama",
    compute_dtype: str | None = None,
    offload: bool = False,
    beta: float = 0.0,
    expert_parallel: bool = False,
    mode: str | None = None,
    routed_to_first_half: bool = False,
    dispatched: bool = False,
    lora: bool = False,
) -> GRPOTrainer:
    """A fp64 tiny trainer; with a mesh whose cp > 1, its engine holds the prompt's state in cp shards; with
    ``fsdp`` its parameters are sharded over every rank of the mesh; with ``compute_dtype``, mixed precision (the
    fp64 parameters are the master weights); with ``beta``, a KL term against a copy of the initial weights (taken
    before sharding, as ``Run`` takes it; ``parallelize`` shards it as the policy); with ``expert_parallel``, each cp
    rank holds and computes its own experts (every extend replicated); ``mode``: the trainer's (None: its
    default); ``routed_to_first_half``: every token's experts among the first half of each MoE layer's (a router
    bias: the first of two cp ranks' under expert parallelism, the other's never chosen); ``dispatched``: under
    expert parallelism, the prompt's capture sharded, its tokens dispatched to their experts' ranks; ``lora``: LoRA
    adapters (random, the same in every process) on every linear layer train instead of the weights."""
    model = tiny_model(family, dtype=torch.float64, seed=0)
    if lora:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            apply_lora(model, LoraSpec(r=4, alpha=8, target_modules="all-linear"), init=False)
    if routed_to_first_half:
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias[: bias.shape[0] // 2] += 10.0
    reference = copy.deepcopy(model) if beta else None
    precision = None if compute_dtype is None else {"compute_dtype": compute_dtype}
    config = GRPOConfig(
        G=G,
        chunk_size=CHUNK,
        lr=1e-2,
        max_grad_norm=1.0,
        normalization=normalization,
        mixed_precision=precision,
        beta=beta,
        **({} if mode is None else {"mode": mode}),
    )
    policy: torch.nn.Module | Engine = model
    if mesh is not None and mesh.mesh["cp"].size() > 1:
        engine = EngineConfig(chunk_size=CHUNK, sharded_extends=dispatched or not expert_parallel)
        policy = Engine(model, engine, shards=ContextParallel(mesh.cp_group, mesh.cp_channels))
    if not fsdp:  # (the trainer places a plain model itself)
        return GRPOTrainer(policy, config, ref_model=reference, accelerator=accelerator, mesh=mesh)
    dtype = None if compute_dtype is None else getattr(torch, compute_dtype)
    placement = parallelize(
        policy, reference, mesh=mesh, fsdp=True, compute_dtype=dtype, offload=offload, expert_parallel=expert_parallel
    )
    return GRPOTrainer(placement, config, accelerator=accelerator)


def step_groups(trainer: GRPOTrainer) -> list[Group]:
    """The step's groups, the same in every process (own generators, not the global RNG)."""
    groups = []
    for k in range(NUM_GROUPS):
        gen = torch.Generator().manual_seed(k)
        prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=gen)
        lengths = torch.randint(2, 6, (G,), generator=gen)
        completions = [torch.randint(0, 256, (int(n),), generator=gen) for n in lengths]
        rewards = torch.rand(G, generator=gen).tolist()
        groups.append(trainer.group_from_completions(prompt, completions, rewards))
    return groups


def share(groups: list[Group], mesh: ParallelMesh) -> list[Group]:
    """A dp rank's groups: with two dp ranks, rank 0 takes the first two, rank 1 the third (uneven on purpose)."""
    if mesh.mesh["dp"].size() == 1:
        return groups
    return groups[:2] if mesh.dp_rank == 0 else groups[2:]


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def local_sizes(model: torch.nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per parameter: (elements this rank stores, the full shape)."""
    return {
        name: ((p.to_local() if isinstance(p, DTensor) else p).numel(), tuple(p.shape))
        for name, p in model.named_parameters()
    }


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce_scatter_tensor", "gather_object")


@contextlib.contextmanager
def stray_collectives(mesh: ParallelMesh, lanes: Sequence[dist.ProcessGroup] = ()) -> Iterator[list[str]]:
    """The names of the collectives called while the block runs on a group other than the mesh's dp and cp groups
    and the shard mesh's lanes (``lanes``; no ``group`` means the default world group, which a dimension spanning
    every process may be)."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    allowed = {mesh.dp_group, mesh.cp_group, *lanes}
    allowed |= {mesh.shard_mesh.get_group()} if mesh.shard_mesh.ndim == 1 else set()

    def recording(name: str, fn):
        def call(*args, group=None, **kwargs):
            if (dist.group.WORLD if group is None else group) not in allowed:
                calls.append(name)
            return fn(*args, group=group, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _gathers(trainer: GRPOTrainer) -> list[Any]:
    """How the step reaches the policy's weights and the KL reference's (``WeightSharding.weights``)."""
    shardings = [trainer.sharding, trainer.placement.reference_sharding]
    return [s.weights for s in shardings if s is not None and s.weights is not None]


def _resumed_step(trainer: GRPOTrainer, mesh: ParallelMesh, spec: dict[str, Any], directory: Path) -> dict:
    """Save a checkpoint (``saved``: the parameters it holds), load it into a fresh trainer, and take one more step
    with both: the parameters must be bit-identical (``equal``, per parameter), and the fresh trainer's counters
    restored."""
    trainer.save_checkpoint(directory)
    saved = full_parameters(trainer.model)
    fresh = make_trainer(spec["normalization"], Accelerator(cpu=True), mesh, spec.get("fsdp", False))
    fresh.load_checkpoint(directory)
    counters = (fresh.step_count, fresh.policy_version)
    for t in (trainer, fresh):
        t.train_step(share(step_groups(t), mesh))
    a, b = full_parameters(trainer.model), full_parameters(fresh.model)
    equal = [torch.equal(a[name], b[name]) for name in a]
    return {"equal": equal, "counters": counters, "files": _listing(directory), "saved": saved}


def _counted_expert_unshards(model: torch.nn.Module) -> list[int]:
    """A counter (one cell) of the gathers of ``model``'s expert units from now on."""
    count = [0]
    for unit in expert_units(model):
        if isinstance(unit, FSDPModule):
            unshard = unit.unshard

            def counted(*args: Any, _unshard: Any = unshard, **kwargs: Any) -> Any:
                count[0] += 1
                return _unshard(*args, **kwargs)

            unit.unshard = counted  # type: ignore[method-assign]
    return count


def _moe_layers(trainer: GRPOTrainer) -> list[Any]:
    return [layer for layer in trainer.engine.adapter.layers if hasattr(layer.mlp, "routed")]


def _expert_rounds(trainer: GRPOTrainer) -> int:
    """The policy's MoE calls made as rounds (a sharded extend's, tokens dispatched to their experts' ranks)."""
    exchanges = {id(ex): ex for ex in (getattr(layer.mlp.routed, "exchange", None) for layer in _moe_layers(trainer))}
    return sum(ex.calls for ex in exchanges.values() if ex is not None)


def _optimized(trainer: GRPOTrainer) -> set[int]:
    """The parameters AdamW holds state for."""
    return {id(p) for p in trainer.optimizer.state}


def _listing(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())


def join(rank: int, world: int, port: int, spec: dict[str, Any]) -> tuple[Accelerator, ParallelMesh]:
    """This forked process's place in a ``world`` of gloo processes: accelerate's CPU state and the ``(dp, cp)``
    mesh of ``spec``; one torch thread (the ranks share the machine's cores). A spawned one (CUDA) records its
    process group calls through $LONGSTRAW_COMM_LOG as a job's process does (a forked one inherits the recording)."""
    record_from_env()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)  # a forked child inherits the parent's 1-process state
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    mesh = ParallelMesh.build(dp=spec["dp"], cp=spec["cp"], hsdp=spec.get("hsdp", False))
    return accelerator, mesh


def run(rank: int, world: int, port: int, out_dir: str, spec: dict[str, Any]) -> None:
    accelerator, mesh = join(rank, world, port, spec)
    trainer = make_trainer(
        spec["normalization"],
        accelerator,
        mesh,
        spec.get("fsdp", False),
        spec.get("family", "llama"),
        spec.get("compute_dtype"),
        spec.get("offload", False),
        spec.get("beta", 0.0),
        spec.get("expert_parallel", False),
        spec.get("mode"),
        spec.get("routed_to_first_half", False),
        spec.get("dispatched", False),
        spec.get("lora", False),
    )
    if "load" in spec:  # a checkpoint another mesh wrote
        trainer.load_checkpoint(spec["load"])
    lanes = [w.lanes.groups for w in _gathers(trainer) if isinstance(w, LaneGather)]
    unshards = _counted_expert_unshards(accelerator.unwrap_model(trainer.model))
    with stray_collectives(mesh, [group for groups in lanes for group in groups]) as stray:
        metrics = trainer.train_step(share(step_groups(trainer), mesh))
    if "save" in spec:
        trainer.save_checkpoint(spec["save"])
    model = accelerator.unwrap_model(trainer.model)
    resumed = _resumed_step(trainer, mesh, spec, Path(out_dir) / "checkpoint") if spec.get("resume") else None
    torch.save(
        {
            "params": full_parameters(model),
            "sizes": local_sizes(model),
            "dp_rank": mesh.dp_rank,
            "stray_collectives": stray,
            "grad_norm": metrics.grad_norm,
            "counters": (trainer.step_count, trainer.policy_version),
            # (per-layer gathers: the most decoder layers whole at once on this rank; None: the step gathers all)
            "most_gathered": None if trainer.sharding.weights is None else trainer.sharding.weights.most_gathered,
            "offloaded": offloaded(model),
            # expert parallelism: the experts' own units, how often one was gathered, and who computes the experts
            "expert_units": sum(isinstance(unit, FSDPModule) for unit in expert_units(model)),
            "experts_unsharded": unshards[0],
            "routed": sorted({type(layer.mlp.routed).__name__ for layer in _moe_layers(trainer)}),
            "expert_rounds": _expert_rounds(trainer),
            "resumed": resumed,
            # (the dtypes AdamW steps in: the parameters it holds and its moments)
            "optimized": sorted(name for name, p in model.named_parameters() if id(p) in _optimized(trainer)),
            "stepped_dtypes": sorted(
                {str(p.dtype) for p in trainer.optimizer.param_groups[0]["params"]}
                | {str(state["exp_avg"].dtype) for state in trainer.optimizer.state.values()}
            ),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()
