"""GRPOTrainer: optimizer steps over groups, checkpoints that resume exactly, on models ``parallelize`` placed.

One step (``train_step``): for each of the ``num_iterations`` (μ) optimizer steps on the same groups, zero grads →
``backward_group`` for each group → mean over groups (over all processes' groups when data parallel; with batch
normalisation the groups' losses are already shares of one batch loss and are summed) → clip → AdamW step; then
step and policy version + 1. Checkpoints hold the model and optimizer state through ``torch.distributed.checkpoint``
(every rank its own shards, or one process the whole; DCP reshards on load, so a checkpoint resumes on any mesh, with
or without FSDP2), the scheduler and RNG states (``accelerate.Accelerator.save_state``) and the trainer's counters;
they are written to a temporary folder and renamed into place, so a kill during a save leaves the previous checkpoint
intact; ``trainer_state.json`` lists every file written and its size, so that a checkpoint missing a file (or holding
one cut short) is refused naming it (``IncompleteCheckpoint``) before anything is read. Resuming from step k and
running to step n gives bit-identical parameters to an uninterrupted run to step n (given the same data per step).

A GRPO step draws no random numbers and the trainer never seeds the global RNGs: seed (or give generators to) whatever
samples the data. Checkpoints carry the global RNG states (accelerate), so a sampler on them resumes exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.memory import host_placement
from longstraw_agents.models.lora import check_exact, check_same_settings, lora_settings, trainable
from longstraw_agents.parallel import ParallelMesh, Placement, parallelize
from longstraw_agents.parallel.checkpoint import load_sharded, save_sharded
from longstraw_agents.parallel.fsdp import WeightSharding, is_sharded, offloaded
from longstraw_agents.token_ids import TokenIds
from longstraw_agents.trainer.config import GRPOConfig
from longstraw_agents.trainer.group import (
    Group,
    batch_weighted,
    completion_members,
    make_group,
    token_array,
    trajectory_group,
)
from longstraw_agents.trainer.grpo import backward_group
from longstraw_agents.trainer.metrics import BackwardResult, IterationMetrics, StepMetrics
from longstraw_agents.trainer.modes import PrefixCache
from longstraw_agents.trajectory import Trajectory

TRAINER_STATE = "trainer_state.json"
OWNERSHIP_STATE = "ownership_{}.json"  # per process: where its cp group places the next pieces (context parallelism)
SAVED_FILES = "files"  # trainer_state.json's listing of every file the save wrote, with its size in bytes
NAMED_AT_MOST = 3  # files an incomplete checkpoint's message names before counting the rest
LORA_STATE = "lora"  # trainer_state.json's record of the policy's LoRA adapters (None: trained whole)


class IncompleteCheckpoint(FileNotFoundError):
    """A checkpoint without some of the files its save wrote (every process's shards, RNG states...), or with some
    cut short: it cannot be loaded, whatever the settings."""


class _Counters:
    """Step counters registered with accelerate so they travel with the checkpoint."""

    def __init__(self) -> None:
        self.step = 0
        self.policy_version = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])


class GRPOTrainer:
    """GRPO over prefix trees with one of the three execution modes.

    model: the policy as ``parallel.parallelize`` placed it (a ``Placement``: FSDP2, mixed precision and the KL
        reference decided there, before the trainer sees either model); or a transformers CausalLM, or an ``Engine``
        over one (to set e.g. ``max_score_elements``, or context parallel ``shards``; its chunk size must equal
        ``config.chunk_size``), which the trainer places through ``parallelize`` without sharding: on the
        accelerator's device, with a compute copy when ``config.mixed_precision`` asks (for one process otherwise
        the identity). ref_model: the frozen KL reference beside a plain model (needed when beta > 0; a
        ``Placement`` holds its own); with context parallelism its state spreads as the policy's.
    mesh: the job's ``(dp, cp)`` mesh (a ``Placement``'s own by default). The trainer's collectives (gradient sums,
        the batch pool) then run over its ``dp`` group only: the ``cp`` ranks of one dp rank hold the same groups
        and compute the same gradients. Without a mesh every process is a data-parallel rank (the default world
        group), as before. A policy FSDP2 shards (``parallelize(..., fsdp=True)``) is gathered a layer at a time
        inside each optimizer step's schedule and its gradients reduce-scattered (``Placement.sharding``); AdamW
        steps each rank's shard and checkpoints are sharded (DCP).
    """

    def __init__(
        self,
        model: nn.Module | Engine | Placement,
        config: GRPOConfig | None = None,
        *,
        ref_model: nn.Module | Engine | None = None,
        accelerator: Accelerator | None = None,
        mesh: ParallelMesh | None = None,
    ):
        self.config = config or GRPOConfig()
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        self.placement = placement = self._placed(model, ref_model, mesh)
        mesh = placement.mesh
        self.dp_group = _data_parallel_group(mesh, self.accelerator.num_processes)
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        engine_config = self._engine_config(placement.policy)
        module = placement.master
        optim = self.config.optim
        if self.config.mode == "exact":
            check_exact(module)
        # the parameters that train: a LoRA policy's adapters (its frozen weights get no gradient and no state)
        optimizer = torch.optim.AdamW(
            trainable(module.parameters()),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        warmup = optim.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        # Model and optimizer are checkpointed by the trainer (DCP, any layout), so accelerate checkpoints only what
        # it is given here: the scheduler, the RNG states and the counters. (The model is on its device already.)
        if mesh is None:
            self.model = self.accelerator.prepare_model(module)
            placement.refresh_compute_copy()  # DDP's wrap broadcast rank 0's masters; the copy follows them
        elif not is_sharded(module):  # no DDP wrapper: its construction broadcasts over the world group, not dp
            self.model = self.accelerator.prepare_model(module, evaluation_mode=True)
        else:
            self.model = module
        self.accelerator.register_save_state_pre_hook(_save_no_model)
        self.accelerator.register_load_state_pre_hook(_load_no_model)
        self.optimizer, self.scheduler = optimizer, self.accelerator.prepare(scheduler)
        self.counters = _Counters()
        self.accelerator.register_for_checkpointing(self.counters)
        # The engine calls the model's submodules directly (embeddings, layers, lm_head) and never the wrapper's
        # forward, so it gets the unwrapped model. With DDP that also bypasses the wrapper's gradient all-reduce
        # (its autograd hooks only fire after a wrapper forward): train_step all-reduces gradients itself.
        self.engine = Engine(placement.computed, engine_config, shards=placement.shards, weights=self.sharding.weights)
        self.ref_engine = _reference_engine(placement, engine_config)
        if self.config.loss.beta > 0 and self.ref_engine is None:
            raise ValueError("GRPOConfig.loss.beta > 0 needs ref_model=... (or parallelize(policy, reference, ...))")

    @property
    def sharding(self) -> WeightSharding:
        """How a step reaches the policy's weights (FSDP2: a layer at a time inside the engine's schedule)."""
        return self.placement.sharding

    def _placed(
        self, model: nn.Module | Engine | Placement, ref_model: nn.Module | Engine | None, mesh: ParallelMesh | None
    ) -> Placement:
        """``model`` as ``parallelize`` placed it; a plain model (and its reference) placed here, unsharded, as
        ``config.mixed_precision`` asks. A ``Placement`` must compute in the dtype the config asks for."""
        precision = self.config.mixed_precision
        wanted = None if precision is None else precision.dtype
        if not isinstance(model, Placement):
            return parallelize(model, ref_model, mesh=mesh, compute_dtype=wanted, device=self.accelerator.device)
        if ref_model is not None:
            raise ValueError(
                "the Placement holds the KL reference: give it to parallelize(policy, reference, ...), not to "
                "GRPOTrainer(ref_model=...)"
            )
        if mesh is not None and mesh is not model.mesh:
            raise ValueError("mesh differs from the mesh the Placement was made over: leave mesh out")
        found = model.compute_dtype
        if found != wanted:
            raise ValueError(
                f"the policy is placed to compute in {found or 'its own dtype'} but GRPOConfig.mixed_precision asks "
                f"for {wanted or 'none'}: place it with parallelize(..., compute_dtype={wanted})"
            )
        return model

    def _engine_config(self, model: nn.Module | Engine) -> EngineConfig:
        if not isinstance(model, Engine):
            return EngineConfig(chunk_size=self.config.chunk_size)
        if model.config.chunk_size != self.config.chunk_size:
            raise ValueError(
                f"the Engine's chunk_size ({model.config.chunk_size}) differs from GRPOConfig.chunk_size "
                f"({self.config.chunk_size}); set them equal (GRPOConfig(chunk_size={model.config.chunk_size}) or "
                f"Engine(model, chunk_size={self.config.chunk_size}))"
            )
        return model.config

    @property
    def step_count(self) -> int:
        return self.counters.step

    @property
    def policy_version(self) -> int:
        return self.counters.policy_version

    # --- groups ---------------------------------------------------------------------------------------------
    def group_from_completions(
        self,
        prompt_ids: TokenIds,
        completions: Sequence[TokenIds],
        rewards: Sequence[float],
        old_logprobs: Sequence[Sequence[float] | None] | None = None,
    ) -> Group:
        """A group of ``config.group_size`` completions of one prompt (token ids must be integers)."""
        if len(completions) != self.config.group_size:
            raise ValueError(
                f"{len(completions)} completions for a group of GRPOConfig.group_size={self.config.group_size}"
            )
        members = completion_members(token_array(prompt_ids, "prompt_ids"), completions, old_logprobs)
        return make_group(members, rewards, self.config.loss)

    def group_from_trajectories(
        self, trajectories: Sequence[Trajectory], rewards: Sequence[float] | None = None
    ) -> Group:
        """A group of whole trajectories, rewards from ``rewards`` or each trajectory's own.

        Any number of trajectories is accepted (not only ``group_size``): offline replay regroups logged episodes
        and forks groups of ``fork_group_size``."""
        return trajectory_group(trajectories, rewards, self.config.loss)

    # --- training -------------------------------------------------------------------------------------------
    def train_step(self, groups: Sequence[Group]) -> StepMetrics:
        """One update on a batch of groups: ``config.num_iterations`` (μ) optimizer steps on the same groups.

        Normalisation (``LossConfig.normalization``): "group" normalises each group's loss within the group (its
        aggregation) and the gradient is the mean of the groups' gradients; "batch" runs the aggregation over all
        members of all groups (of every process when data parallel) as one pool, so token-mean divides by the loss
        tokens of the whole batch, as TRL's "dapo" (TRL's loss_type names select it). With one group they agree.
        Data parallel: each dp rank passes its own groups (the cp ranks of one dp rank the same ones); gradients are
        all-reduced here over the dp group (the engine bypasses DDP's forward and so its hooks). Metrics describe
        this process's groups.

        μ > 1 (TRL's num_iterations): every optimizer step takes the ratio against the behaviour logprobs recorded
        at sampling, so each loss token needs one (the first step is on-policy when they come from these weights).
        ``capture_reuse`` (detached mode) captures each group's context in the first step and reuses it in the
        others: exact in the first, approximate after (``trainer.modes.PrefixCache``). The step and policy-version
        counters advance once per call: the intermediate weights never sample.
        """
        if not groups:
            raise ValueError("train_step needs at least one group")
        if self.config.num_iterations > 1:
            _check_behaviour_logprobs(groups, self.config.num_iterations)
        batch = self._normalised(groups)
        caches = [PrefixCache() if self.config.capture_reuse else None for _ in batch]
        self.model.train()
        first: list[BackwardResult] = []
        iterations = []
        for _ in range(self.config.num_iterations):
            results, iteration = self._optimizer_step(batch, caches)
            first = first or results
            iterations.append(iteration)
        self.counters.step += 1
        self.counters.policy_version += 1
        return StepMetrics.of_iterations(
            first,
            iterations,
            step=self.counters.step,
            policy_version=self.counters.policy_version,
            mode=self.config.mode,
        )

    def _normalised(self, groups: Sequence[Group]) -> list[Group]:
        """The groups as the loss weights them: as built ("group"), or re-weighted over the whole batch ("batch")."""
        if self.config.loss.normalization == "group":
            return list(groups)
        own = [n for g in groups for n in g.episode_loss_tokens()]
        if self.dp_group is None:
            return batch_weighted(groups, self.config.loss)
        gathered: list[list[int] | None] = [None] * self.dp_size
        dist.all_gather_object(gathered, own, group=self.dp_group)
        rank = dist.get_rank(self.dp_group)
        offset = sum(len(lengths or []) for lengths in gathered[:rank])
        pool = [n for lengths in gathered for n in lengths or []]
        return batch_weighted(groups, self.config.loss, pool, offset)

    def _optimizer_step(
        self, groups: Sequence[Group], caches: Sequence[PrefixCache | None]
    ) -> tuple[list[BackwardResult], IterationMetrics]:
        self.optimizer.zero_grad(set_to_none=True)
        config = self.config
        weights = self.placement.reference_sharding if config.loss.beta > 0 else None
        reference = weights.step() if weights is not None else contextlib.nullcontext()
        # FSDP2: gathered for the step (the root, or all), gradients reduce-scattered after; the reference likewise
        with self.sharding.step(), reference:
            results = [
                backward_group(self.engine, g, config.mode, config.loss, self.ref_engine, config.track_memory, cache)
                for g, cache in zip(groups, caches, strict=True)
            ]
            params = [p for p in self.model.parameters() if p.requires_grad]
            total_groups = self._sum_gradients_across_processes(params, len(groups))
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        summed = config.loss.normalization == "batch"  # the groups' losses are shares of one batch loss
        if not summed:
            for p in params:
                p.grad.div_(total_groups)
        with self._optimizer_placement():
            grad_norm = self._clip(params)
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
        self.placement.refresh_compute_copy()
        self.scheduler.step()
        return results, IterationMetrics.of_groups(results, grad_norm=grad_norm, lr=lr, summed=summed)

    def _optimizer_placement(self) -> contextlib.AbstractContextManager[None]:
        """Where the clip and the step allocate, for the memory tracker: the host's memory when the shards are
        offloaded (FSDP2 keeps them, their gradients and AdamW's state there, so the arithmetic runs there), else
        the device's."""
        return host_placement(offloaded(self.model))

    def _sum_gradients_across_processes(self, params: list[nn.Parameter], num_groups: int) -> int:
        """All-reduce (sum) the gradients and group counts of the data-parallel ranks; returns the total group count.

        A parameter without a gradient on every process keeps ``grad=None`` (AdamW then skips it, as in one
        process); one with a gradient somewhere gets zeros where it had none, so every process reduces the same
        tensors in the same order."""
        if self.dp_group is None:
            return num_groups
        device = self.accelerator.device
        flags = torch.tensor([num_groups] + [p.grad is not None for p in params], dtype=torch.int64, device=device)
        dist.all_reduce(flags, group=self.dp_group)
        for p, present in zip(params, flags[1:].tolist(), strict=True):  # counts of processes with a gradient
            if present and p.grad is None:
                p.grad = torch.zeros_like(p)
        if is_sharded(self.model):  # (sharded, each layer's gradient is in its shards by the step block's end)
            return int(flags[0])
        handles = [dist.all_reduce(p.grad, group=self.dp_group, async_op=True) for p in params if p.grad is not None]
        for handle in handles:
            handle.wait()
        return int(flags[0])

    def _clip(self, params: list[nn.Parameter]) -> float:
        max_norm = self.config.optim.max_grad_norm
        if not params:
            return 0.0
        if max_norm is None:
            return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    # --- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Write a checkpoint atomically (temporary folder, then rename).

        Several processes: every one writes its RNG states and its shards of the model and optimizer state into the
        temporary folder; after a barrier the main process alone adds the counters and renames it into place, and a
        last barrier keeps the others from going on (or being killed) before the checkpoint is whole."""
        final = Path(directory)
        tmp = final.with_name(final.name + ".tmp")
        main = self.accelerator.is_main_process
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        save_sharded(self.accelerator.unwrap_model(self.model), self.optimizer, tmp)
        self._save_ownership(tmp)
        self.accelerator.wait_for_everyone()
        if main:  # every process's files are written (the barrier): list them, so that a load can check them
            state = {**self.counters.state_dict(), "config": self.config.model_dump(mode="json")}
            state[LORA_STATE] = lora_settings(self.accelerator.unwrap_model(self.model))
            (tmp / TRAINER_STATE).write_text(json.dumps({**state, SAVED_FILES: _file_sizes(tmp)}, indent=2))
            old = final.with_name(final.name + ".old")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Restore a checkpoint written on any mesh (DCP reshards the model and optimizer state to this one's)."""
        path = self.resolve_checkpoint(directory)
        self.check_complete(path)
        check_same_settings(self.checkpoint_info(path).get(LORA_STATE), self.accelerator.unwrap_model(self.model))
        self.accelerator.load_state(str(path))
        load_sharded(self.accelerator.unwrap_model(self.model), self.optimizer, path)
        self._load_ownership(path)
        self.placement.refresh_compute_copy()

    def _save_ownership(self, directory: Path) -> None:
        """With context parallelism, what this process's placements depend on of the earlier ones (each dp rank's
        cp group makes calls of its own): a resumed run places turns as the uninterrupted run would have, so that
        the ranks' partials merge in the same order and the run stays bit-exact."""
        if self.engine.shards is not None:
            state = self.engine.shards.ownership.state_dict()
            (directory / OWNERSHIP_STATE.format(self.accelerator.process_index)).write_text(json.dumps(state))

    def _load_ownership(self, directory: Path) -> None:
        """What ``_save_ownership`` wrote for this process; a checkpoint of another cp size (or of no context
        parallelism) leaves the placements to start afresh — only the rounding of the partials' merge depends on
        them, and a run resumed on another mesh does not repeat the old one's rounding anyway. The ranks of one cp
        group read files of one group: processes are numbered cp-major (``ParallelMesh``), so a group's processes
        are the same ones at any dp, and the files of a group are all there or all missing."""
        path = directory / OWNERSHIP_STATE.format(self.accelerator.process_index)
        if self.engine.shards is None or not path.exists():
            return
        state = json.loads(path.read_text())
        if state.get("size") == self.engine.shards.ownership.size:
            self.engine.shards.ownership.load_state_dict(state)

    @staticmethod
    def resolve_checkpoint(directory: str | os.PathLike) -> Path:
        """The checkpoint folder to read: ``directory``, or its ``.old`` twin when a save was killed after moving
        the previous checkpoint aside and before renaming the new one into place."""
        path = Path(directory)
        if (path / TRAINER_STATE).exists():
            return path
        previous = path.with_name(path.name + ".old")
        if (previous / TRAINER_STATE).exists():
            return previous
        raise FileNotFoundError(f"{path} is not a GRPOTrainer checkpoint (no {TRAINER_STATE})")

    @classmethod
    def checkpoint_info(cls, directory: str | os.PathLike) -> dict[str, Any]:
        return json.loads((cls.resolve_checkpoint(directory) / TRAINER_STATE).read_text())

    @classmethod
    def check_complete(cls, directory: str | os.PathLike) -> None:
        """Raise ``IncompleteCheckpoint`` naming the files of the checkpoint in ``directory`` that are missing or
        shorter than its save wrote them (a checkpoint written before saves listed their files is not checked)."""
        path = cls.resolve_checkpoint(directory)
        saved: dict[str, int] = cls.checkpoint_info(path).get(SAVED_FILES, {})
        missing = [name for name in saved if not (path / name).is_file()]
        short = [
            f"{name} is cut short ({size:,} of {saved[name]:,} bytes)"
            for name in saved
            if name not in missing and (size := (path / name).stat().st_size) < saved[name]
        ]
        if missing or short:
            problems = "; ".join(_missing(missing) + short)
            raise IncompleteCheckpoint(f"the checkpoint in {path} is incomplete: {problems}")


def _file_sizes(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (by its path relative to it) and its size in bytes."""
    return {
        file.relative_to(directory).as_posix(): file.stat().st_size
        for file in sorted(directory.rglob("*"))
        if file.is_file()
    }


def _missing(names: list[str]) -> list[str]:
    """``names`` of missing files as a message names them: the first few, then how many more."""
    if not names:
        return []
    named = ", ".join(names[:NAMED_AT_MOST])
    more = f" and {len(names) - NAMED_AT_MOST} more files" if len(names) > NAMED_AT_MOST else ""
    return [f"{named}{more} {'is' if len(names) == 1 else 'are'} missing"]


def _save_no_model(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
    """accelerate's save pre-hook: its checkpoint leaves out the model (the trainer's DCP checkpoint holds it)."""
    weights.clear()


def _load_no_model(models: list[nn.Module], input_dir: str) -> None:
    """accelerate's load pre-hook: the model comes from the trainer's DCP checkpoint."""
    models.clear()


def _data_parallel_group(mesh: ParallelMesh | None, num_processes: int) -> dist.ProcessGroup | None:
    """The group gradients are summed over: the mesh's ``dp`` group; without a mesh, every process (the world
    group, named explicitly); None when there is nothing to reduce."""
    if mesh is not None:
        return mesh.dp_group if mesh.mesh["dp"].size() > 1 else None
    return dist.group.WORLD if num_processes > 1 else None


def _check_behaviour_logprobs(groups: Sequence[Group], num_iterations: int) -> None:
    """μ > 1 takes every optimizer step's ratio against the behaviour logprobs: a loss token without one would be
    treated as on-policy in every step, silently dropping the clipping the later steps rely on."""
    for g, group in enumerate(groups):
        for k, member in enumerate(group.members):
            targets = member.loss_mask.copy()
            targets[0] = False  # position 0 is never predicted
            if member.logprobs is None or np.isnan(member.logprobs[targets]).any():
                raise ValueError(
                    f"num_iterations={num_iterations} needs behaviour logprobs on every loss token (the ratio of "
                    f"the later optimizer steps is against them); episode {group.episodes[k]} of group {g} lacks "
                    "some. Sample with a sampler that records them (TorchSampler, OpenAISampler) or pass old_logprobs"
                )


def _reference_engine(placement: Placement, engine_config: EngineConfig) -> Engine | None:
    """The KL reference's engine over its placed module (its own engine settings when it was given as an
    ``Engine``, else the policy's); with context parallelism its state spread over the policy's cp ranks as the
    policy's is (``placement.shards``), not whole on every rank; sharded, its layers gathered as the policy's are."""
    reference = placement.reference
    if reference is None:
        return None
    module = reference.model if isinstance(reference, Engine) else reference
    config = reference.config if isinstance(reference, Engine) else engine_config
    sharding = placement.reference_sharding
    weights = sharding.weights if sharding is not None else None
    return Engine(module, config, shards=placement.shards, weights=weights)
