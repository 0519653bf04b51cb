"""GRPOTrainer: configuration, optimizer steps, gradient clipping, and checkpoints that resume bit-exactly in a fresh
process — also when the process that wrote them was SIGKILLed right after, or in the middle of, a save."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import typing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from grpo_reference import flat, parameter_grads, relative_l2

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import BalancedOwnership
from longstraw_agents.parallel.discipline import record_from_env
from longstraw_agents.trainer import (
    MODES,
    GRPOConfig,
    GRPOTrainer,
    LossConfig,
    ModeName,
    OptimizerConfig,
    backward_group,
)
from longstraw_agents.trajectory import Segment, Trajectory

TESTS = Path(__file__).resolve().parent
PROMPT_LEN, CHUNK, G = 20, 8, 3


def make_trainer(
    mode: str = "exact", max_grad_norm: float | None = 1.0, lr: float = 1e-2, accelerator=None, **config
) -> GRPOTrainer:
    net = tiny_model("llama", seed=0)
    cfg = GRPOConfig(G=G, mode=mode, chunk_size=CHUNK, lr=lr, max_grad_norm=max_grad_norm, **config)
    return GRPOTrainer(net, cfg, accelerator=accelerator)


def step_groups(trainer: GRPOTrainer, step: int, num_groups: int = 2):
    """The groups of one step. Completions and rewards are drawn from the global torch RNG — like a sampler
    would — so that an exact resume also needs the checkpoint's RNG states."""
    groups = []
    for k in range(num_groups):
        prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(100 * step + k))
        completions = [torch.randint(0, 256, (int(n),)) for n in torch.randint(2, 6, (G,))]
        rewards = torch.rand(G).tolist()
        groups.append(trainer.group_from_completions(prompt, completions, rewards))
    return groups


def parameters(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


# --- configuration ------------------------------------------------------------------------------------------------
def test_flat_names_land_in_the_nested_configs():
    flat_config = GRPOConfig(G=4, epsilon=0.1, lr=1e-3)
    assert flat_config.group_size == 4 and flat_config.loss.epsilon == 0.1 and flat_config.optim.lr == 1e-3
    nested = GRPOConfig(group_size=4, loss=LossConfig(epsilon=0.1), optim=OptimizerConfig(lr=1e-3))
    assert flat_config == nested
    trl_names = GRPOConfig(num_generations=6, learning_rate=2e-5, loss_type="dr-grpo", beta=0.04, max_grad_norm=None)
    assert trl_names.group_size == 6 and trl_names.optim.lr == 2e-5 and trl_names.optim.max_grad_norm is None
    assert trl_names.loss.aggregation == "dr-grpo" and trl_names.loss.beta == 0.04


def test_flat_names_merge_with_a_nested_section():
    config = GRPOConfig(loss=LossConfig(beta=0.1, epsilon=0.3), epsilon_high=0.4, optim={"weight_decay": 0.1}, lr=1)
    assert (config.loss.beta, config.loss.epsilon, config.loss.epsilon_high) == (0.1, 0.3, 0.4)
    assert (config.optim.weight_decay, config.optim.lr) == (0.1, 1.0)


def test_flat_eps_is_refused_because_it_is_ambiguous():
    """A TRL user writing eps=0.2 means the clip range; AdamW would have read it."""
    with pytest.raises(pydantic.ValidationError, match="adam_epsilon.*'epsilon' for the clip"):
        GRPOConfig(eps=0.2)
    assert GRPOConfig(optim={"eps": 1e-6}).optim.eps == 1e-6  # the nested form stays unambiguous
    assert GRPOConfig(epsilon=0.3).loss.epsilon == 0.3


def test_hf_optimizer_names_land_in_the_optimizer_config():
    config = GRPOConfig(
        learning_rate=3e-4,
        adam_epsilon=1e-6,
        adam_beta1=0.8,
        adam_beta2=0.95,
        weight_decay=0.1,
        max_grad_norm=0.5,
        warmup_steps=3,
    )
    assert config.optim == OptimizerConfig(
        lr=3e-4, eps=1e-6, betas=(0.8, 0.95), weight_decay=0.1, max_grad_norm=0.5, warmup_steps=3
    )
    assert config.loss == LossConfig()  # nothing leaked into the loss (the clip epsilon keeps its default)
    assert GRPOConfig(adam_beta2=0.9, optim={"betas": (0.5, 0.6)}).optim.betas == (0.5, 0.9)


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    [("dapo", "token-mean"), ("bnpo", "token-mean"), ("grpo", "seq-mean"), ("dr_grpo", "dr-grpo")],
)
def test_trl_loss_type_names_are_accepted(loss_type, aggregation):
    config = GRPOConfig(loss_type=loss_type)
    assert config.loss.aggregation == aggregation
    assert GRPOConfig.model_validate_json(config.model_dump_json()) == config


def test_two_spellings_of_one_option_are_an_error():
    with pytest.raises(pydantic.ValidationError, match="learning_rate.*lr"):
        GRPOConfig(lr=1e-3, learning_rate=1e-4)


def test_config_round_trips_through_json():
    config = GRPOConfig(G=4, mode="detached", epsilon=0.1, epsilon_high=0.2, beta=0.01, lr=3e-4, chunk_size=64)
    assert GRPOConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize(
    ("kwargs", "loc"),
    [
        ({"G": 0}, ("group_size",)),
        ({"mode": "full"}, ("mode",)),
        ({"chunk_size": 0}, ("chunk_size",)),
        ({"lr": 0.0}, ("optim", "lr")),
        ({"max_grad_norm": -1.0}, ("optim", "max_grad_norm")),
        ({"epsilon": -0.2}, ("loss", "epsilon")),
        ({"aggregation": "mean"}, ("loss", "aggregation")),
        ({"loss": {"beta": -1.0}}, ("loss", "beta")),
        ({"gradient_accumulation": 4}, ("gradient_accumulation",)),
        ({"seed": 0}, ("seed",)),  # the trainer draws no random numbers: there is nothing to seed
    ],
)
def test_bad_config_values_name_the_field(kwargs, loc):
    with pytest.raises(pydantic.ValidationError) as info:
        GRPOConfig(**kwargs)
    assert [error["loc"] for error in info.value.errors()] == [loc]


def test_every_configurable_mode_is_one_execution_mode():
    assert GRPOConfig.model_fields["mode"].annotation is ModeName  # one definition of the mode names
    assert set(typing.get_args(ModeName)) == set(MODES) == {"naive", "detached", "exact"}


def test_beta_without_a_reference_model_is_rejected():
    with pytest.raises(ValueError, match="ref_model"):
        GRPOTrainer(tiny_model("llama"), GRPOConfig(beta=0.1))


def test_reference_model_is_moved_to_the_device_frozen_and_in_eval_mode():
    reference = tiny_model("llama", seed=1).train()
    moved_to = []
    to = reference.to
    reference.to = lambda *args, **kwargs: (moved_to.append(args), to(*args, **kwargs))[1]
    trainer = GRPOTrainer(tiny_model("llama"), GRPOConfig(beta=0.1, chunk_size=CHUNK), ref_model=reference)
    assert moved_to == [(trainer.accelerator.device,)]
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert trainer.ref_engine.config.chunk_size == CHUNK


@pytest.mark.gpu
def test_reference_model_follows_the_policy_to_the_gpu():
    reference = tiny_model("llama", seed=1)
    trainer = GRPOTrainer(tiny_model("llama"), GRPOConfig(beta=0.1), ref_model=reference)
    assert {p.device.type for p in reference.parameters()} == {trainer.accelerator.device.type} == {"cuda"}


def test_the_policy_itself_is_refused_as_reference():
    net = tiny_model("llama")
    with pytest.raises(ValueError, match="copy"):
        GRPOTrainer(net, GRPOConfig(beta=0.1), ref_model=net)


def test_an_engine_is_accepted_when_its_chunk_size_matches_the_config():
    net = tiny_model("llama")
    with pytest.raises(ValueError, match=r"chunk_size \(4\) differs from GRPOConfig.chunk_size \(8\)"):
        GRPOTrainer(Engine(net, chunk_size=4), GRPOConfig(chunk_size=8))
    engine = Engine(net, EngineConfig(chunk_size=8, max_score_elements=1000))
    trainer = GRPOTrainer(engine, GRPOConfig(chunk_size=8))
    assert trainer.engine.config == engine.config and trainer.engine.model is net


# --- groups ---------------------------------------------------------------------------------------------------
def test_completion_groups_must_have_group_size_members():
    trainer = make_trainer()
    prompt = torch.arange(1, 6)
    with pytest.raises(ValueError, match="2 completions for a group of GRPOConfig.group_size=3"):
        trainer.group_from_completions(prompt, [torch.tensor([1]), torch.tensor([2])], [0.0, 1.0])


@pytest.mark.parametrize(
    "bad",
    [[1.0, 2.0], np.array([1.5, 2.0]), torch.tensor([True, False]), torch.tensor([1.0, 2.0]), [True, False]],
    ids=["float-list", "numpy-float", "bool-tensor", "float-tensor", "bool-list"],
)
def test_non_integer_token_ids_are_refused_not_truncated(bad):
    trainer = make_trainer()
    good = [torch.tensor([1, 2])] * G
    with pytest.raises(TypeError, match="token ids must be integers"):
        trainer.group_from_completions(torch.arange(1, 6), [bad, *good[1:]], [0.0, 1.0, 0.5])
    with pytest.raises(TypeError, match="prompt_ids: token ids must be integers"):
        trainer.group_from_completions(bad, good, [0.0, 1.0, 0.5])
    group = trainer.group_from_completions(np.arange(1, 6), [[1, 2], np.array([3]), torch.tensor([4])], [0, 1, 0.5])
    assert group.num_loss_tokens == 4


def test_trajectories_without_a_reward_are_an_error_not_zero():
    trainer = make_trainer()
    trajectories = [Trajectory([Segment("user", [1, 2]), Segment("assistant", [3 + k])]) for k in range(2)]
    trajectories[0].reward = 1.0
    with pytest.raises(ValueError, match=r"trajectories \[1\] have no reward"):
        trainer.group_from_trajectories(trajectories)
    assert trainer.group_from_trajectories(trajectories, rewards=[1.0, 0.0]).rewards == [1.0, 0.0]


# --- steps ----------------------------------------------------------------------------------------------------
def test_steps_change_the_parameters_and_advance_the_policy_version():
    trainer = make_trainer()
    before = parameters(trainer)
    assert trainer.step_count == trainer.policy_version == 0
    for step in range(3):
        metrics = trainer.train_step(step_groups(trainer, step))
        assert metrics.step == metrics.policy_version == step + 1 == trainer.policy_version
    after = parameters(trainer)
    assert relative_l2(after, before) > 1e-3
    assert metrics.mode == "exact" and metrics.grad_norm > 0
    assert metrics.loss_tokens > 0 and metrics.unique_tokens > 2 * PROMPT_LEN
    with pytest.raises(ValueError, match="at least one group"):
        trainer.train_step([])


def test_step_metrics_are_a_frozen_record_with_a_plain_dict_form():
    trainer = make_trainer()
    metrics = trainer.train_step(step_groups(trainer, 0))
    assert list(metrics.to_dict()) == [
        "step", "policy_version", "mode", "loss", "reward_mean", "reward_std", "grad_norm", "lr", "loss_tokens",
        "unique_tokens", "sequence_tokens", "forward_tokens", "seconds", "peak_bytes", "kl", "iterations",
    ]  # fmt: skip
    assert json.loads(json.dumps(metrics.to_dict())) == metrics.to_dict()
    [iteration] = metrics.to_dict()["iterations"]  # one optimizer step (num_iterations=1)
    assert iteration["loss"] == metrics.loss and iteration["grad_norm"] == metrics.grad_norm
    assert metrics.peak_bytes is None and metrics.kl is None  # memory not tracked, no KL term
    with pytest.raises(AttributeError):
        metrics.loss = 0.0


def test_the_trainer_leaves_the_global_random_state_alone():
    """No hidden reseeding: building a trainer and stepping it leaves torch's, numpy's and Python's global
    generators where they were."""
    torch.manual_seed(123)
    groups = step_groups(make_trainer(), 0)
    net = tiny_model("llama", seed=0)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    trainer = GRPOTrainer(net, GRPOConfig(G=G, chunk_size=CHUNK))
    trainer.train_step(groups)
    after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]


def test_a_step_uses_the_mean_of_the_groups_gradients_and_the_configured_mode():
    """After a step without clipping, ``param.grad`` holds the mean of the groups' gradients, each computed by
    ``backward_group`` on its own; exact and naive trainers agree, detached differs."""
    grads = {}
    for mode in ("exact", "naive", "detached"):
        torch.manual_seed(0)
        trainer = make_trainer(mode, max_grad_norm=None)
        groups = step_groups(trainer, 0)
        expected = {}
        for group in groups:
            trainer.model.zero_grad(set_to_none=True)
            backward_group(trainer.engine, group, mode, trainer.config.loss)
            expected = {n: expected.get(n, 0) + g / len(groups) for n, g in parameter_grads(trainer.model).items()}
        metrics = trainer.train_step(groups)
        grads[mode] = parameter_grads(trainer.model)
        assert relative_l2(grads[mode], expected) <= 1e-6
        assert metrics.grad_norm == pytest.approx(float(flat(expected).norm()), rel=1e-5)
    assert relative_l2(grads["exact"], grads["naive"]) <= 1e-5
    assert relative_l2(grads["detached"], grads["naive"]) > 1e-2


def _data_parallel_worker(rank: int, port: int, out: str, normalization: str) -> None:
    """Rank 0 trains on groups 0 and 1 of step 0, rank 1 on group 2 (2 gloo CPU processes); both save their
    gradients and parameters. (Spawned, it records its process group calls as a job's process does.)"""
    record_from_env()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)  # a forked child inherits the parent's 1-process state
    GradientState._reset_state()
    torch.manual_seed(0)  # the data's seed (the trainer itself leaves the global RNGs alone)
    trainer = make_trainer(accelerator=Accelerator(cpu=True), normalization=normalization)
    assert trainer.accelerator.num_processes == 2
    groups = step_groups(trainer, 0, num_groups=3)
    trainer.train_step(groups[:2] if rank == 0 else groups[2:])
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    params = {name: p.detach().clone() for name, p in unwrapped.named_parameters()}
    torch.save((parameter_grads(unwrapped), params), f"{out}.{rank}")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize("normalization", ["group", "batch"])
def test_data_parallel_step_equals_one_process_on_the_union_of_the_groups(tmp_path, normalization):
    """The engine bypasses DDP's forward (so DDP's all-reduce hooks never fire): two processes with 2 and 1 groups
    must end the step with the gradients and parameters of one process given all 3 groups. With batch
    normalisation the pool of members spans both processes (each process's weights come from all of them)."""
    # fork: the children skip re-importing torch (~10 s on 2 busy cores); spawn once CUDA is initialised here
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    args = (_free_port(), str(tmp_path / "rank"), normalization)
    mp.start_processes(_data_parallel_worker, args=args, nprocs=2, start_method=start_method)
    torch.manual_seed(0)  # the same data as the workers
    trainer = make_trainer(normalization=normalization)
    trainer.train_step(step_groups(trainer, 0, num_groups=3))
    expected_grads, expected_params = parameter_grads(trainer.model), parameters(trainer)
    for rank in range(2):
        grads, params = torch.load(tmp_path / f"rank.{rank}")
        assert relative_l2(grads, expected_grads) <= 1e-5, rank
        assert relative_l2(params, expected_params) <= 1e-5, rank


def _compute_copy_worker(rank: int, port: int, out: str) -> None:
    """Each rank starts from weights of its own seed, fp64 masters computing in fp32; saves the masters and the
    engine's copy after the trainer is built."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    net = tiny_model("llama", dtype=torch.float64, seed=rank)
    cfg = GRPOConfig(G=G, chunk_size=CHUNK, mixed_precision={"compute_dtype": "float32"})
    trainer = GRPOTrainer(net, cfg, accelerator=Accelerator(cpu=True))
    copy = trainer.placement.compute_copy
    assert copy is not None
    masters = {
        name: p.detach().clone() for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
    }
    torch.save((masters, {name: p.detach().clone() for name, p in copy.compute.named_parameters()}), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_processes_started_from_different_weights_compute_with_rank_0s_after_ddp_broadcasts_them(tmp_path):
    """DDP's wrap copies rank 0's masters to every rank; the low-precision copy the engine computes with must follow
    (it was made before the wrap), else a rank's first step computes at its own starting weights."""
    start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(
        _compute_copy_worker, args=(_free_port(), str(tmp_path / "rank")), nprocs=2, start_method=start_method
    )
    rank0_masters, _ = torch.load(tmp_path / "rank.0")
    for rank in range(2):
        masters, copy = torch.load(tmp_path / f"rank.{rank}")
        for name, master in masters.items():
            assert torch.equal(master, rank0_masters[name]), (rank, name)
            assert torch.equal(copy[name], master.float()), (rank, name)


@pytest.mark.parametrize("max_norm", [1e-3, None])
def test_gradient_clipping_reports_the_raw_norm_and_clips_to_max(max_norm):
    trainer = make_trainer(max_grad_norm=max_norm)
    metrics = trainer.train_step(step_groups(trainer, 0))
    clipped_norm = float(flat(parameter_grads(trainer.model)).norm())
    assert metrics.grad_norm > 1e-2  # the raw norm, before clipping
    expected = metrics.grad_norm if max_norm is None else max_norm
    assert clipped_norm == pytest.approx(expected, rel=1e-4)


def test_trajectory_groups_train_and_report_peak_memory():
    trainer = make_trainer(track_memory=True)
    prompt = [Segment("system", list(range(10, 30))), Segment("user", list(range(30, 40)))]
    trajectories = [
        Trajectory([*prompt, Segment("assistant", [1, 2, 3]), Segment("tool", [4, 5]), Segment("assistant", [6])]),
        Trajectory([*prompt, Segment("assistant", [1, 2, 3]), Segment("tool", [4, 5]), Segment("assistant", [7])]),
        Trajectory([*prompt, Segment("assistant", [8, 9])]),
    ]
    for traj, reward in zip(trajectories, (1.0, 0.0, 0.5), strict=True):
        traj.reward = reward
    metrics = trainer.train_step([trainer.group_from_trajectories(trajectories)])
    assert metrics.reward_mean == pytest.approx(0.5) and metrics.loss_tokens == 4 + 4 + 2
    assert metrics.unique_tokens == 30 + 3 + 2 + 1 + 1 + 2
    assert metrics.peak_bytes > 0


# --- checkpoints ------------------------------------------------------------------------------------------------
TOTAL_STEPS, SAVE_AT = 4, 2


def _worker(spec: dict) -> None:
    """Run a trainer in this (fresh) process as ``spec`` says; write its parameters and counters to spec["out"].

    spec: ckpt (folder), load (resume from ckpt first), steps (run until this step), save_at (steps after which
    to save), kill ("after_save": SIGKILL right after the save at the last save_at; "in_state": during the state
    write of that save; "between_renames": after the old checkpoint was moved aside, before the new one is in place).
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the data's seed; a resumed worker gets the saved RNG states from the checkpoint
    trainer = make_trainer()
    if spec["load"]:
        trainer.load_checkpoint(spec["ckpt"])
    resumed_at = trainer.step_count
    for step in range(trainer.step_count, spec["steps"]):
        trainer.train_step(step_groups(trainer, step))
        if step + 1 in spec["save_at"]:
            if step + 1 == spec["save_at"][-1] and spec.get("kill"):
                _arm_kill(trainer, spec["kill"])
            trainer.save_checkpoint(spec["ckpt"])
    torch.save(parameters(trainer), spec["out"])
    Path(spec["out"] + ".json").write_text(
        json.dumps({"resumed_at": resumed_at, "step": trainer.step_count, "policy_version": trainer.policy_version})
    )


def _arm_kill(trainer: GRPOTrainer, when: str) -> None:
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if when == "after_save":
        save = trainer.save_checkpoint
        trainer.save_checkpoint = lambda directory: (save(directory), die())
    elif when == "in_state":
        save_state = trainer.accelerator.save_state
        trainer.accelerator.save_state = lambda directory: (save_state(directory), die())
    elif when == "between_renames":
        rename = Path.rename

        def rename_then_die(self: Path, target):
            moved = rename(self, target)
            if str(target).endswith(".old"):
                die()
            return moved

        Path.rename = rename_then_die
    else:
        raise ValueError(f"unknown kill point {when!r}")


def _run_in_forks(specs: dict[str, dict]) -> dict[str, int]:
    """Run the writers in parallel, each in a process forked from this one (they need no fresh process: only the
    resumes do, and the children skip re-importing torch); their exit codes by name (None: still running after
    300 s, then killed). A writer that fails leaves its traceback in ``spec["out"] + ".err"``."""
    # spawn once CUDA is initialised here (a forked child could not use it)
    context = multiprocessing.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    procs = {name: context.Process(target=_logged_worker, args=(spec,)) for name, spec in specs.items()}
    for proc in procs.values():
        proc.start()
    deadline = time.monotonic() + 300
    for proc in procs.values():
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    exits = {name: proc.exitcode for name, proc in procs.items()}
    for proc in procs.values():
        if proc.is_alive():  # no writer outlives the test
            proc.kill()
            proc.join()
    return exits


def _logged_worker(spec: dict) -> None:
    try:
        _worker(spec)
    except BaseException:
        Path(spec["out"] + ".err").write_text(traceback.format_exc())
        raise


def _resume_in_a_fresh_process(specs: dict[str, dict]) -> dict[str, str]:
    """Run the resumes one after another in one fresh process (a new interpreter: nothing of the writers' processes
    but the checkpoints reaches it); the tracebacks of those that failed, by name. Each resume builds a new trainer
    and reseeds the global generators before loading, so what one leaves behind cannot stand in for what the next
    one's checkpoint must restore: its RNG states, counters, parameters and AdamW state."""
    code = (
        "import json, sys, traceback; sys.path[:0] = sys.argv[1:3]; import test_trainer\n"
        "for spec in json.loads(sys.argv[3]):\n"
        "    try:\n"
        "        test_trainer._worker(spec)\n"
        "    except Exception:\n"
        "        open(spec['out'] + '.err', 'w').write(traceback.format_exc())\n"
    )
    paths = [str(TESTS), str(TESTS.parent / "support")]
    done = subprocess.run(
        [sys.executable, "-c", code, *paths, json.dumps(list(specs.values()))],
        stderr=subprocess.PIPE, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    errors = {name: Path(spec["out"] + ".err") for name, spec in specs.items()}
    return {name: error.read_text()[-3000:] for name, error in errors.items() if error.exists()}


KILL_POINTS = ["after_save", "in_state", "between_renames"]


@dataclass
class ResumeRuns:
    """Parameters and counters each finished worker wrote, by worker name; the uninterrupted run's checkpoint."""

    results: dict[str, tuple[dict[str, torch.Tensor], dict]] = field(repr=False)
    failures: dict[str, str] = field(repr=False)  # resume workers that exited with an error: their traceback
    checkpoint: Path

    def finished(self, name: str) -> tuple[dict[str, torch.Tensor], dict]:
        assert name not in self.failures, f"worker {name} failed:\n{self.failures[name]}"
        return self.results[name]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> ResumeRuns:
    """Phase 1 (in parallel, forked): an uninterrupted run that also saves at SAVE_AT, and one run per kill point
    that is SIGKILLed at its save (for the mid-save kills, the save at SAVE_AT is complete and the next one is cut).
    Phase 2: a fresh process resumes from each checkpoint in turn (the uninterrupted run's first) and runs to
    TOTAL_STEPS."""
    root = tmp_path_factory.mktemp("resume")
    first = {"uninterrupted": {"steps": TOTAL_STEPS, "save_at": [SAVE_AT]}}
    for kill in KILL_POINTS:
        save_at = [SAVE_AT] if kill == "after_save" else [SAVE_AT, SAVE_AT + 1]
        first[kill] = {"steps": TOTAL_STEPS, "save_at": save_at, "kill": kill}
    for name, spec in first.items():
        spec.update(ckpt=str(root / name / "ckpt"), load=False, out=str(root / f"{name}.pt"))
    exits = _run_in_forks(first)
    uninterrupted_error = Path(first["uninterrupted"]["out"] + ".err")
    assert exits["uninterrupted"] == 0, uninterrupted_error.read_text() if uninterrupted_error.exists() else exits
    for kill in KILL_POINTS:
        assert exits[kill] == -signal.SIGKILL, (kill, exits[kill])

    second = {
        f"resume-{name}": {**spec, "load": True, "save_at": [], "kill": None, "out": str(root / f"resume-{name}.pt")}
        for name, spec in first.items()
    }
    failures = _resume_in_a_fresh_process(second)
    results = {
        name: (torch.load(spec["out"]), json.loads(Path(spec["out"] + ".json").read_text()))
        for name, spec in {**first, **second}.items()
        if Path(spec["out"]).exists()
    }
    return ResumeRuns(results, failures, root / "uninterrupted" / "ckpt")


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bit_exact(resume_runs):
    expected, done = resume_runs.results["uninterrupted"]
    resumed, info = resume_runs.finished("resume-uninterrupted")
    assert done == {"resumed_at": 0, "step": TOTAL_STEPS, "policy_version": TOTAL_STEPS}
    assert info == {"resumed_at": SAVE_AT, "step": TOTAL_STEPS, "policy_version": TOTAL_STEPS}
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


@pytest.mark.slow
@pytest.mark.parametrize("kill", KILL_POINTS)
def test_resume_after_sigkill_is_bit_exact(resume_runs, kill):
    """Killed right after a save, or in the middle of the next one: the last complete checkpoint (step SAVE_AT)
    is what loads, and continuing from it reproduces the uninterrupted parameters."""
    assert kill not in resume_runs.results  # the killed process never finished
    expected, _ = resume_runs.results["uninterrupted"]
    resumed, info = resume_runs.finished(f"resume-{kill}")
    assert info["resumed_at"] == SAVE_AT and info["policy_version"] == TOTAL_STEPS
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


@pytest.mark.slow
def test_checkpoint_info_describes_the_checkpoint(resume_runs):
    info = GRPOTrainer.checkpoint_info(resume_runs.checkpoint)
    assert info["step"] == info["policy_version"] == SAVE_AT
    assert GRPOConfig.model_validate(info["config"]) == make_trainer().config


def test_save_then_load_in_process_restores_counters_and_parameters(tmp_path):
    trainer = make_trainer()
    trainer.train_step(step_groups(trainer, 0))
    saved = parameters(trainer)
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.save_checkpoint(tmp_path / "ckpt")  # overwriting a checkpoint leaves one complete folder, no debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    trainer.train_step(step_groups(trainer, 1))
    assert trainer.policy_version == 2
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert trainer.step_count == trainer.policy_version == 1
    assert all(torch.equal(p, saved[name]) for name, p in parameters(trainer).items())


@dataclass
class _ContextShards:
    """What an engine over cp ranks holds (``StateShards``); a checkpoint reads and writes only its ownership."""

    ownership: BalancedOwnership
    transport: typing.Any = None


def test_a_checkpoint_keeps_where_the_cp_ranks_place_the_next_turns(tmp_path):
    """At cp > 1 the ranks place a turn by what each holds of its path, ties by what each was given so far (G alike
    members' turns spread over the ranks). Each process's ownership goes into the checkpoint: a resumed run places
    turns as the uninterrupted one, so that its partials merge in the same order (a run of 3 steps resumed for a 4th
    ended with weights 8e-8 apart at cp = 2 before). Another cp size starts afresh."""

    def trainer_over(ranks: int) -> tuple[GRPOTrainer, BalancedOwnership]:
        shards = _ContextShards(BalancedOwnership(0, ranks))
        engine = Engine(tiny_model("llama", seed=0), EngineConfig(chunk_size=CHUNK), shards=shards)  # type: ignore[arg-type]
        return GRPOTrainer(engine, GRPOConfig(G=G, chunk_size=CHUNK)), shards.ownership

    trainer, ownership = trainer_over(2)
    ownership.assign([10, 10], [7, 3])  # given [7, 3]: the next tie goes to rank 1 (a fresh ownership's to rank 0)
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed, placed = trainer_over(2)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert placed.given == ownership.given == [7, 3]
    assert placed.assign([20, 20], [4]) == ownership.assign([20, 20], [4]) == [1]
    elsewhere, fresh = trainer_over(4)
    elsewhere.load_checkpoint(tmp_path / "ckpt")
    assert fresh.given == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="over 2 ranks does not resume over 4"):
        fresh.load_state_dict(ownership.state_dict())


def test_loading_a_folder_that_is_not_a_checkpoint_fails_clearly(tmp_path):
    trainer = make_trainer()
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is not a GRPOTrainer checkpoint"):
        trainer.load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a GRPOTrainer checkpoint"):
        trainer.load_checkpoint(tmp_path / "missing")
    assert trainer.step_count == 0
