"""One rank of the per-rank memory tests (tests/test_planner_distributed.py): the real training step on a
``(dp, cp)`` mesh with FSDP2 over every rank, under a ``MemoryTracker`` that attributes each rank's peak bytes by role
(``parallel.roles``: weights, gradients, optimizer state, gathered weights and gradients, captured state, the rest).
The tracker opens before the model is built, so every byte the rank holds is counted; the peak is that of a second
step (the first allocates AdamW's state and FSDP2's gathered parameters, which later steps reuse).
Then a group's rollout as the run samples in process (``roll_out``), its peak measured too. ``out_dir/rank{r}.pt``
gets the peaks and the step's bytes by role."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from data_parallel_worker import join
from torch import nn

from bench.agent_scale import agent_members
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models.lora import LoraSpec, apply_lora
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.parallel import ContextParallel, ParallelMesh, parallelize
from longstraw_agents.parallel.roles import step_roles
from longstraw_agents.parallel.sampling import FollowingSampler, LeadingSampler, SamplerCalls
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer
from longstraw_agents.trainer.group import Group, make_group


def make_trainer(spec: dict[str, Any], mesh: ParallelMesh, accelerator: Accelerator) -> GRPOTrainer:
    config = TINY_PRESETS[spec["family"]](**spec["model"])
    model = build_model(config, dtype=torch.float32, seed=0)
    if spec.get("lora"):  # (as Run applies them: before the reference's copy and the sharding)
        model = apply_lora(model, LoraSpec(**spec["lora"]))
    reference = copy.deepcopy(model) if spec.get("beta") else None  # (as Run copies it: before sharding)
    compute = getattr(torch, spec["compute_dtype"]) if spec["compute_dtype"] else None
    experts = spec.get("expert_parallel", False)
    grpo = GRPOConfig(
        G=spec["group"],
        chunk_size=spec["chunk"],
        lr=1e-3,
        mode=spec["mode"],
        beta=spec.get("beta", 0.0),
        mixed_precision=None if compute is None else {"compute_dtype": spec["compute_dtype"]},
    )
    policy: nn.Module | Engine = model
    if mesh.mesh["cp"].size() > 1:
        shards = ContextParallel(mesh.cp_group, mesh.cp_channels)
        engine = EngineConfig(
            chunk_size=spec["chunk"],
            wavefront_walk=spec["wavefront_walk"],
            sharded_extends=spec.get("dispatched", False) or not experts,
        )
        policy = Engine(model, engine, shards=shards)
    offload = spec.get("offload", False)
    placement = parallelize(
        policy, reference, mesh=mesh, fsdp=True, compute_dtype=compute, offload=offload, expert_parallel=experts
    )
    return GRPOTrainer(placement, grpo, accelerator=accelerator)


def step_group(trainer: GRPOTrainer, spec: dict[str, Any], seed: int) -> Group:
    gen = torch.Generator().manual_seed(seed)
    vocab = spec["model"].get("vocab_size", 256)
    prompt = torch.randint(0, vocab, (spec["prompt"],), generator=gen)
    if spec.get("history"):
        return agent_group(trainer, spec, prompt, gen)
    completions = [torch.randint(0, vocab, (spec["completion"],), generator=gen) for _ in range(spec["group"])]
    rewards = [float(k % 2) for k in range(spec["group"])]
    return trainer.group_from_completions(prompt, completions, rewards)


def agent_group(trainer: GRPOTrainer, spec: dict[str, Any], prompt: torch.Tensor, gen: torch.Generator) -> Group:
    """Members that part after ``prompt`` and grow a history of ``spec["history"]`` tokens each over
    ``spec["turns"]`` turns: a tool output, then an answer of ``spec["completion"]`` tokens with loss."""
    vocab = spec["model"].get("vocab_size", 256)
    members = agent_members(prompt, spec["history"], spec["turns"], spec["completion"], spec["group"], vocab, gen)
    rewards = [float(k % 2) for k in range(spec["group"])]
    return make_group(members, rewards, trainer.config.loss)


def roll_out(trainer: GRPOTrainer, spec: dict[str, Any], mesh: ParallelMesh) -> None:
    """A group's rollout as ``longstraw train`` samples in process (``app.training``, ``Run.sampling``): the cp
    ranks sample together with the trainer's engine (each holding its share of every member's state), the first
    leading and the others following its calls; its layers gathered one at a time, as the step gathers them; the
    members decoded together; the stop token is outside the vocabulary, so every member decodes to its limit."""
    vocab = spec["model"].get("vocab_size", 256)
    weights = trainer.sharding.weights
    block = contextlib.nullcontext() if weights is None else weights.gathered(None)
    sampling = SamplingConfig(max_new_tokens=spec["completion"], seed=0)
    with torch.no_grad(), block:
        if mesh.cp_group.size() == 1:
            sampler: TorchSampler = TorchSampler(trainer.engine, [vocab], sampling)
        else:
            calls = SamplerCalls(mesh.cp_group)
            if not calls.leads:
                FollowingSampler(trainer.engine, [vocab], sampling, calls=calls).follow()
                return
            sampler = LeadingSampler(trainer.engine, [vocab], sampling, calls=calls)
        prompt = torch.randint(0, vocab, (spec["prompt"],), generator=torch.Generator().manual_seed(3))
        handles = sampler.fork(prompt.tolist(), spec["group"])
        sampler.generate_batch(handles, [spec["completion"]] * spec["group"])
        if isinstance(sampler, LeadingSampler):
            sampler.close()


def run(rank: int, world: int, port: int, out_dir: str, spec: dict[str, Any]) -> None:
    accelerator, mesh = join(rank, world, port, spec)
    with MemoryTracker() as tracker:
        trainer = make_trainer(spec, mesh, accelerator)
        model = accelerator.unwrap_model(trainer.model)
        with step_roles(model, trainer.optimizer, on_state=tracker.snapshot) as roles:
            tracker.roles = roles
            trainer.train_step([step_group(trainer, spec, seed=1)])
            tracker.reset_peak()
            trainer.train_step([step_group(trainer, spec, seed=2)])
            tracker.snapshot()  # every gradient shard reduced: the most the step holds of them
            measured = {"cp_rank": mesh.cp_rank, "peak": tracker.peak_bytes, "roles": tracker.peak_roles}
            measured["host_peak"] = tracker.host_peak_bytes
            reference = trainer.ref_engine.model if trainer.ref_engine is not None else model
            measured["buffer_dtypes"] = [[str(b.dtype) for b in m.buffers()] for m in (model, reference)]
            measured["role_peaks"] = tracker.role_peaks
            tracker.reset_peak()
            if not spec.get("history"):  # (an agent's rollout is a run's, turn by turn: not simulated here)
                roll_out(trainer, spec, mesh)
            measured["rollout_peak"], measured["rollout_roles"] = tracker.peak_bytes, tracker.peak_roles
    torch.save(measured, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
