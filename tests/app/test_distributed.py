"""``longstraw train`` on 4 processes (dp=2 x cp=2, FSDP2) from ``torchrun`` and ``accelerate launch``
(app/distributed.py): each dp rank rolls out its share of every step's tasks and its cp peers train on the same
groups with the context sharded, the writer stores each group once and writes one metrics line per step covering both
dp ranks' groups, the checkpoint resumes and exports to a Hugging Face directory; and the parallel settings are
checked before anything runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
import yaml
from grpo_reference import relative_l2
from launches import launch
from tiny_runs import tiny_config_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from tracker_logs import as_float32, expected_scalars, tensorboard_scalars
from transformers import AutoModelForCausalLM

from longstraw_agents.app.config import ConfigError, ParallelSpec, TrainConfig
from longstraw_agents.app.distributed import SHARED_MARK, Ranks, directory_problem, merged_step_metrics
from longstraw_agents.app.export import export_hf
from longstraw_agents.app.seeds import task_seed
from longstraw_agents.cli import main
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.engine.sharded_capture import ShardedCapture
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import BalancedOwnership
from longstraw_agents.store import Store
from longstraw_agents.trainer import StepMetrics

GROUPS_PER_STEP, GROUP_SIZE, PROCESSES = 2, 4, "4"
STEPS = 2  # of the dp x cp run: one launched, one resumed


def _stored_groups(run_dir: Path) -> dict[str, list[int | None]]:
    """group id -> the task seeds of its episodes."""
    store = Store.open(run_dir / "trajectories.db", create=False)
    try:
        return {group_id: [t.seed for t in members] for group_id, members in store.groups().items()}
    finally:
        store.close()


@pytest.mark.distributed
@pytest.mark.slow
def test_dp_and_cp_ranks_store_each_group_once_and_resume(tmp_path: Path) -> None:
    """dp=2 x cp=2 with FSDP2 (the replicated checkpoint's resume is tested on the trainer,
    tests/trainer/test_data_parallel.py): a step launched by torchrun, sharded over all four ranks, then --resume to
    2 by accelerate launch with HSDP (each dp rank's cp ranks shard the model, gathering a layer at a time; DCP
    reshards the checkpoint, and the resumed run saves over it). The trainer spreads each group's shared context over
    both cp ranks, so the shard boundary falls inside it. (A second step within one launch adds nothing the resumed
    step does not run: each launch trains, stores, reports and checkpoints a step the same way.)"""
    run_dir = tmp_path / "run"
    config = tmp_path / "train.yaml"
    settings = tiny_config_dict(run_dir, parallel={"dp": 2, "cp": 2, "fsdp": True}, steps=1)
    settings["model"] = {**settings["model"], "max_context": 1024}
    # weight decay moves the weights even without a reward signal, so the export is told apart from a fresh init
    # bf16 mixed precision: FSDP2 gathers bf16 weights for compute, AdamW steps the fp32 shards (exported as fp32)
    settings["trainer"] = {**settings["trainer"], "weight_decay": 0.1, "bf16": True}
    settings["report_to"] = ["tensorboard"]  # the writer alone reports
    config.write_text(yaml.safe_dump(settings))
    done = launch("torchrun", config, processes=PROCESSES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("step    1 ") == 1  # one metrics line per step, printed by the writer only
    settings["parallel"] = {**settings["parallel"], "hsdp": True}
    config.write_text(yaml.safe_dump(settings))
    resumed = launch("accelerate", config, "--resume", "--steps", str(STEPS), processes=PROCESSES)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    groups = _stored_groups(run_dir)
    assert sorted(groups) == [f"step{s}-dp{r}-g0" for s in range(1, STEPS + 1) for r in range(2)]
    for group_id, seeds in groups.items():
        assert len(seeds) == GROUP_SIZE and len(set(seeds)) == 1, group_id  # each group once, whole
    for step in range(STEPS):  # the dp ranks split the step's tasks: every task once
        seeds = sorted(groups[f"step{step + 1}-dp{r}-g0"][0] for r in range(2))  # ids count steps from 1
        assert seeds == [task_seed(0, step, g) for g in range(GROUPS_PER_STEP)]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:  # a step's line covers both ranks' groups
        assert sum(line["finish_reasons"].values()) == GROUPS_PER_STEP * GROUP_SIZE
        assert line["episode_tokens_mean"] > 512  # the episodes cross the cp shard boundary
    # one events file per launch (another rank's tracker would add its own), holding each step once
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert tensorboard_scalars(run_dir / "tensorboard") == as_float32(expected_scalars(run_dir, {}))
    checkpoint = {p.name for p in (run_dir / "checkpoint").iterdir()}
    assert {f"random_states_{r}.pkl" for r in range(4)} | {"trainer_state.json"} <= checkpoint
    assert "sharded" in checkpoint and "model.safetensors" not in checkpoint
    assert json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["step"] == STEPS
    assert json.loads((run_dir / "config.json").read_text())["parallel"]["hsdp"]  # the settings it now runs with

    # The sharded checkpoint exported as a Hugging Face directory holds what torch's own DCP converter reads.
    exported = AutoModelForCausalLM.from_pretrained(export_hf(run_dir, tmp_path / "hf"))
    dcp_to_torch_save(run_dir / "checkpoint" / "sharded", tmp_path / "whole.pt")
    reference = torch.load(tmp_path / "whole.pt")["model"]
    for name, param in exported.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, reference[name]), name


# NeedleSearch: members share the task and part from the first sampled token, then grow turn by turn (tool outputs)
NEEDLE = {"id": "LongStraw/NeedleSearch-v0", "kwargs": {"target_tokens": 4096, "max_turns": 4}}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("offload", "agents", "experts"),
    [(False, True, False), (True, False, True)],
    ids=["on-the-device-agents", "offloaded-dispatched-experts"],
)
def test_a_run_over_two_cp_ranks_equals_one_process(tmp_path: Path, offload: bool, agents: bool, experts: bool) -> None:
    """``longstraw train`` with ``parallel: {dp: 1, cp: 2, fsdp: true}`` (the published run's shape, fp64), and with
    ``offload: true`` (the shards, their gradients and AdamW on the host): both cp ranks sample together (the first
    running the environments), the sharded model gathered a layer at a time; both ranks train on the group with its
    context sharded; the episodes stored are the ones one process samples, and the exported weights after the step
    are its weights (fp64, relative 1e-10). Whatever the rewards (an untrained policy rarely solves one), the step's
    second iteration has a gradient: the first one's weight decay moved the policy from the KL reference.
    ``agents``: NeedleSearch episodes whose members part at once and grow several times the shared part, turn by
    turn, in exact mode over 64-token chunks (each member's history spread over both ranks, turns of 64 tokens or
    more computed sharded). ``experts``: the MoE family (a dense layer, then one of 8 experts) with
    ``expert_parallel: true``, each cp rank holding and computing 4 of them, and ``expert_dispatch: true``: the
    prompt's captures (sampling's and training's) sharded, each token sent to its experts' rank and back; the
    rest replicated."""
    runs = {}
    for name, parallel in (("cp2", {"dp": 1, "cp": 2, "fsdp": True, "offload": offload}), ("one", {})):
        env = {"env": NEEDLE} if agents else {}
        if agents and parallel:
            parallel = {**parallel, "sharded_extend_tokens": 64}
        if experts and parallel:
            parallel = {**parallel, "expert_parallel": True, "expert_dispatch": True}
        settings = tiny_config_dict(tmp_path / name, parallel=parallel, steps=1, groups_per_step=1, **env)
        settings["model"] = {**settings["model"], "max_context": 8192 if agents else 1024, "dtype": "float64"}
        if experts:
            settings["model"] |= {"preset": "glm_moe_dsa", "overrides": {"hidden": 32, "layers": 2}}
        trainer = {"weight_decay": 0.1, "beta": 0.1, "num_iterations": 2} | ({"chunk_size": 64} if agents else {})
        settings["trainer"] = {**settings["trainer"], **trainer}
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(settings))
        runs[name] = config
    done = launch("torchrun", runs["cp2"], processes="2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["train", str(runs["one"])]) == 0
    stored = {name: _stored_episodes(tmp_path / name) for name in runs}
    assert stored["cp2"] == stored["one"] and len(stored["one"]) == GROUP_SIZE
    if agents:
        shared = _common_prefix(stored["one"])
        assert all(len(episode) >= shared + 3 * 64 for episode in stored["one"]), [len(e) for e in stored["one"]]
    weights = {}
    for name in runs:
        exported = AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / name, tmp_path / f"{name}-hf"))
        weights[name] = {key: p.detach() for key, p in exported.named_parameters()}
    assert relative_l2(weights["cp2"], weights["one"]) <= 1e-10
    norms = {name: _iteration_grad_norms(tmp_path / name) for name in runs}
    assert norms["one"][1] > 0 and norms["cp2"] == pytest.approx(norms["one"], rel=1e-8)


def _common_prefix(sequences: list[list[int]]) -> int:
    """How many leading tokens every sequence shares."""
    shortest = min(len(s) for s in sequences)
    return next((k for k in range(shortest) if len({s[k] for s in sequences}) > 1), shortest)


def _iteration_grad_norms(run_dir: Path) -> list[float]:
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return [iteration["grad_norm"] for iteration in step["iterations"]]


def _stored_episodes(run_dir: Path) -> list[list[int]]:
    store = Store.open(run_dir / "trajectories.db", create=False)
    try:
        return [t.token_ids().tolist() for members in store.groups().values() for t in members]
    finally:
        store.close()


def test_dp_times_cp_must_equal_the_number_of_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"parallel\.dp \(2\) x parallel\.cp \(1\).*WORLD_SIZE=3"):
        Ranks.join(ParallelSpec(dp=2), "cpu")


def test_groups_meant_to_stay_inside_a_node_must_fit_the_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes of 4 processes and cp groups of 3: refused before joining, naming the settings."""
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"parallel\.cp \(3\) does not fit nodes of 4 processes.*across_nodes=dp"):
        Ranks.join(ParallelSpec(dp=2, cp=3), "cpu")


def test_a_process_that_sees_another_run_directory_says_so(tmp_path: Path) -> None:
    """The writer's mark (a token) is what tells its directory from another one at the same path."""
    writers = tmp_path / "run"
    writers.mkdir()
    (writers / SHARED_MARK).write_text("abc")
    assert directory_problem(writers, "abc") is None
    assert (
        directory_problem(writers, "def")
        == f"{writers} is another directory there (without the mark rank 0 just wrote into its own)"
    )
    assert directory_problem(tmp_path / "elsewhere", "abc") == f"{tmp_path / 'elsewhere'} does not exist there"
    assert [p.name for p in writers.iterdir()] == [SHARED_MARK]  # the write check leaves nothing


def test_every_dp_rank_needs_a_group_of_each_step(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"parallel\.dp \(4\) .* groups_per_step \(2\)"):
        TrainConfig.model_validate(tiny_config_dict(tmp_path, parallel={"dp": 4}))


def _metrics(rewards: list[float], loss: float, loss_tokens: int) -> StepMetrics:
    return StepMetrics(
        step=1,
        policy_version=1,
        mode="exact",
        loss=loss,
        reward_mean=float(np.mean(rewards)),
        reward_std=float(np.std(rewards)),
        grad_norm=0.5,
        lr=1e-3,
        loss_tokens=loss_tokens,
        unique_tokens=loss_tokens,
        sequence_tokens=2 * loss_tokens,
        forward_tokens=loss_tokens,
        seconds=1.0,
        peak_bytes=None,
        kl=None,
    )


@pytest.mark.parametrize("summed", [False, True], ids=["group", "batch"])
def test_merged_metrics_pool_the_ranks_members(summed: bool) -> None:
    """Rank 0 holds 2 groups of 2 members, rank 1 one group: the merged reward statistics are those of all 6
    members; the loss is the group-weighted mean (group normalisation) or the sum of the ranks' shares (batch)."""
    rewards = [[1.0, 0.0, 0.5, 0.5], [1.0, 1.0]]
    merged = merged_step_metrics([_metrics(rewards[0], 0.3, 10), _metrics(rewards[1], 0.6, 4)], [2, 1], summed)
    pooled = rewards[0] + rewards[1]
    assert merged.reward_mean == pytest.approx(np.mean(pooled))
    assert merged.reward_std == pytest.approx(np.std(pooled))
    assert merged.loss == pytest.approx(0.9 if summed else (2 * 0.3 + 0.6) / 3)
    assert merged.loss_tokens == 14 and merged.sequence_tokens == 28 and merged.grad_norm == 0.5


def test_parallel_balanced_captures_reaches_the_engine_and_cuts_the_capture() -> None:
    """``engine.balanced_captures`` (on by default) cuts a capture in 2cp parts, rank r the r-th and the
    (2cp - 1 - r)-th; off, in rank order — a capture exact mode's wavefront walk will walk back (its state keeps
    checkpoints, so the capture keeps layer inputs) too."""
    assert EngineConfig().balanced_captures
    model = tiny_model("llama", seed=0)
    owners = {}
    for balanced in (True, False):
        config = EngineConfig(chunk_size=8, balanced_captures=balanced)
        engine = Engine(model, config, shards=_OneRanksView(BalancedOwnership(0, 2)))  # type: ignore[arg-type]
        for checkpoints in (False, True):
            capture = ShardedCapture(engine.kit, engine.shards, engine.empty_state(checkpoints), torch.arange(64), 8)
            owners[balanced, checkpoints] = capture.owners
    assert owners[True, False] == owners[True, True] == [0, 0, 1, 1, 1, 1, 0, 0]
    assert owners[False, False] == owners[False, True] == [0, 0, 0, 0, 1, 1, 1, 1]


@dataclass
class _OneRanksView:
    """What an engine over cp ranks holds (``StateShards``), of which a capture's plan reads only the ownership."""

    ownership: BalancedOwnership
    transport: Any = None
