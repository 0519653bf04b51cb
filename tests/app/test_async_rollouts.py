"""Asynchronous GRPO (``max_staleness``, app/async_rollouts.py): the equalities it must keep (staleness 0 is the
synchronous loop bit for bit; at staleness 1 a step trains what offline replay of its stored episodes trains), the
versions it records (an episode going on across a weight update holds turns of two versions, each sampled by its
own weights), resume (from the checkpoint, training again from the store the steps stored after it), and the
refusals. Rollouts are ordered with events, never with timing. The runs are tiny (a random-init llama, 2 groups of 4,
turns of 6 tokens, 2-3 steps) on ``coin_env``, whose rewards are mixed from the first step."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import coin_env
import httpx
import numpy as np
import pytest
import torch
import yaml
from launches import launch
from tiny_runs import assert_same_weights, checkpoint_weights, tiny_config

from longstraw_agents.app.async_rollouts import (
    TRAIN_VERSION,
    RolloutWorker,
    SnapshotSampler,
    Stopped,
    VersionGate,
    WorkerSampler,
    architecture_copy,
    group_staleness,
    publishable,
    within_bound,
)
from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.replay import ReplayConfig, select_logged_groups
from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import OpenAISampler, SamplerError
from longstraw_agents.serving import CompletionServer, RequestError
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.trainer import GRPOTrainer
from longstraw_agents.trajectory import Segment, Trajectory

WAIT_S = 120.0  # events are set within milliseconds; the bound only keeps a broken test from hanging


def async_config(run_dir: Path, **updates: Any) -> TrainConfig:
    settings: dict[str, Any] = {
        "env": {"id": coin_env.ENV_ID, "kwargs": dict(coin_env.KWARGS)},
        "steps": 3,
        "trainer": {"group_size": 4, "lr": 5e-2, "max_grad_norm": None},
        "sampling": {"max_new_tokens": 6},
        **updates,
    }
    return tiny_config(run_dir, **settings)


def grpo_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["phase"] == "grpo"]


def stored(run_dir: Path) -> dict[str, list[Trajectory]]:
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        return store.groups()


TRAINING = ("step", "policy_version", "loss", "reward_mean", "reward_std", "grad_norm", "lr", "loss_tokens")


def test_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path: Path) -> None:
    """max_staleness 0 runs the rollout thread, the weight snapshot and the per-step store of the asynchronous loop,
    and gives the synchronous loop's checkpoint, metrics and episodes exactly (3 steps with a real gradient)."""
    train(async_config(tmp_path / "sync"))
    train(async_config(tmp_path / "async", max_staleness=0))
    assert_same_weights(checkpoint_weights(tmp_path / "sync"), checkpoint_weights(tmp_path / "async"))
    sync, later = grpo_lines(tmp_path / "sync"), grpo_lines(tmp_path / "async")
    assert [{k: line[k] for k in TRAINING} for line in sync] == [{k: line[k] for k in TRAINING} for line in later]
    assert sum(line["grad_norm"] > 0 for line in sync) >= 2  # mixed rewards: the steps learned something
    assert [(line["staleness_max"], line["groups_dropped_stale"]) for line in later] == [(0, 0)] * 3
    expected, got = stored(tmp_path / "sync"), stored(tmp_path / "async")
    assert sorted(expected) == sorted(got) == [f"step{s}-g{g}" for s in (1, 2, 3) for g in (0, 1)]
    for group_id, members in expected.items():
        assert sorted(members, key=_tokens) == sorted(got[group_id], key=_tokens)
        for t in got[group_id]:  # every turn was sampled by the step's own weights, which trained on it
            versions = {s.policy_version for s in t.segments if s.role == "assistant"}
            assert versions == {t.info[TRAIN_VERSION]} == {int(group_id[4]) - 1}


def _tokens(t: Trajectory) -> tuple[int, ...]:
    return tuple(t.token_ids().tolist())


class _Ordered:
    """Orders the rollout thread against the training loop with events: step 1's update waits until the thread has
    sampled the first turn of step 2's episodes (with version 0), and their second turn waits for version 1, so that
    these episodes go on across the update (one turn of each version). Records the weights of each version."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.first_turn_of_step_2 = threading.Event()
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, float] = {}
        self.turns: dict[int, int] = {}  # id(sampler) -> turns asked of it
        self.samplers: list[int] = []
        before_turn, train_step = SnapshotSampler.before_turn, GRPOTrainer.train_step
        ordered = self

        def before(sampler: SnapshotSampler, handles: Any) -> None:
            if handles:
                if id(sampler) not in ordered.turns:
                    ordered.samplers.append(id(sampler))
                ordered.turns[id(sampler)] = ordered.turns.get(id(sampler), 0) + 1
                second_step = ordered.samplers.index(id(sampler)) == 1
                if second_step and ordered.turns[id(sampler)] == 2:
                    ordered.first_turn_of_step_2.set()
                    assert sampler.snapshot.wait_for(1)
            before_turn(sampler, handles)

        def step(trainer: GRPOTrainer, groups: Any) -> Any:
            version = trainer.policy_version
            ordered.weights[version] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            if version == 0:
                assert ordered.first_turn_of_step_2.wait(WAIT_S)
            metrics = train_step(trainer, groups)
            ordered.grads[version] = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
            ordered.losses[version] = metrics.loss
            return metrics

        monkeypatch.setattr(SnapshotSampler, "before_turn", before)
        monkeypatch.setattr(GRPOTrainer, "train_step", step)


def test_staleness_1_trains_what_offline_replay_of_the_stored_episodes_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 trains, at version 1, episodes whose first turn version 0 sampled and whose second version 1 sampled
    (each given its whole context: the members' states are recomputed with the new weights). Its loss and gradient
    equal those of offline replay (``select_logged_groups``, a trainer at the same weights, TIS) of the same episodes
    read back from the store, in fp64; the truncated importance weights of the first turns are not 1."""
    ordered = _Ordered(monkeypatch)
    loss = {"importance": "tis", "tis_cap": 3.0}
    config = async_config(
        tmp_path / "run",
        steps=2,
        max_staleness=1,
        model={"preset": "llama", "overrides": {"hidden": 32, "layers": 1}, "dtype": "float64"},
        trainer={"group_size": 4, "lr": 5e-2, "max_grad_norm": None, "loss": loss},
    )
    train(config)
    monkeypatch.undo()

    episodes = [
        t for group_id, members in stored(tmp_path / "run").items() if group_id.startswith("step2-") for t in members
    ]
    for t in episodes:  # each went on across the update: one turn of each version
        assert [s.policy_version for s in t.segments if s.role == "assistant"] == [0, 1]
        assert t.info[TRAIN_VERSION] == 1 and t.policy_version == 0
    assert grpo_lines(tmp_path / "run")[1]["staleness_max"] == 1

    # each turn is a draw of the weights it records, given the episode's whole context
    model = _policy(config)
    for version, turn in ((0, 0), (1, 1)):
        model.load_state_dict(ordered.weights[version], strict=False)
        for t in episodes:
            assert _turn_logprobs(model, t, turn) == pytest.approx(_recorded(t, turn), abs=1e-5)

    # offline replay of step 2's stored episodes, by a trainer at version 1's weights
    model.load_state_dict(ordered.weights[1], strict=False)
    replayer = GRPOTrainer(model, config.trainer)
    with Store.open(tmp_path / "run" / "trajectories.db", create=False) as store:
        where = "group_id LIKE 'step2-%'"
        groups, _ = select_logged_groups(store, ReplayConfig(where=where, tis_cap=3.0), policy_version=1)
    assert len(groups) == 2  # (both groups have mixed rewards: select_logged_groups skips uniform ones)
    metrics = replayer.train_step([replayer.group_from_trajectories(g) for g in groups])
    assert metrics.loss == pytest.approx(ordered.losses[1], rel=1e-12, abs=1e-15)
    for name, param in replayer.model.named_parameters():
        torch.testing.assert_close(param.grad, ordered.grads[1][name], rtol=1e-10, atol=1e-13)
    weights = [np.exp(_turn_logprobs(model, t, 0) - _recorded(t, 0)) for t in episodes]
    assert max(abs(w - 1).max() for w in weights) > 1e-3  # stale first turns: the correction is at work


def _policy(config: TrainConfig) -> torch.nn.Module:
    from longstraw_agents.app.config import check_model
    from longstraw_agents.app.run import build_policy
    from longstraw_agents.tokenizer import load_tokenizer

    return build_policy(config.model, check_model(config.model, load_tokenizer().vocab_size), config.seed)


def _assistant(t: Trajectory, turn: int) -> tuple[int, Segment]:
    index = [k for k, s in enumerate(t.segments) if s.role == "assistant"][turn]
    return index, t.segments[index]


def _recorded(t: Trajectory, turn: int) -> np.ndarray:
    return _assistant(t, turn)[1].logprobs.astype(np.float64)


def _turn_logprobs(model: torch.nn.Module, t: Trajectory, turn: int) -> np.ndarray:
    """The log-probabilities ``model`` gives the turn's tokens after everything before them (a full forward)."""
    index, segment = _assistant(t, turn)
    context = np.concatenate([s.token_ids for s in t.segments[:index]])
    ids = torch.as_tensor(np.concatenate([context, segment.token_ids]), dtype=torch.long)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)
    positions = torch.arange(len(context) - 1, len(ids) - 1)
    return logp[positions, ids[len(context) :]].numpy()


def test_train_runs_async_and_resumes_training_the_steps_stored_after_its_checkpoint_again(tmp_path: Path) -> None:
    """``longstraw train`` with max_staleness 1, 3 steps. A run whose checkpoint is of step 2 but whose store holds
    step 3 (killed after storing it) resumes by training step 3 again from the store: the same episodes, so the
    uninterrupted run's weights exactly, and nothing rolled out or stored twice."""
    run_dir = tmp_path / "run"
    config = tmp_path / "train.yaml"
    settings = async_config(run_dir, steps=2, max_staleness=1).model_dump(mode="json")
    config.write_text(yaml.safe_dump(settings))
    assert main(["train", str(config)]) == 0
    shutil.copytree(run_dir / "checkpoint", tmp_path / "checkpoint-2")
    assert main(["train", str(config), "--resume", "--steps", "3"]) == 0
    assert [line["step"] for line in grpo_lines(run_dir)] == [1, 2, 3]
    assert [line["staleness_max"] <= 1 for line in grpo_lines(run_dir)] == [True] * 3  # (how stale: timing's)
    uninterrupted = checkpoint_weights(run_dir)
    episodes = sum(len(members) for members in stored(run_dir).values())
    assert episodes == 3 * 2 * 4

    shutil.rmtree(run_dir / "checkpoint")
    shutil.copytree(tmp_path / "checkpoint-2", run_dir / "checkpoint")
    assert main(["train", str(config), "--resume", "--steps", "3"]) == 0
    assert_same_weights(checkpoint_weights(run_dir), uninterrupted)
    assert sum(len(members) for members in stored(run_dir).values()) == episodes


def test_resuming_with_another_max_staleness_is_refused_and_changes_nothing(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "train.yaml"
    settings = async_config(run_dir, steps=1, max_staleness=1).model_dump(mode="json")
    config.write_text(yaml.safe_dump(settings))
    assert main(["train", str(config)]) == 0
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    for other in (2, None):
        config.write_text(yaml.safe_dump({**settings, "max_staleness": other}))
        assert main(["train", str(config), "--resume", "--steps", "2"]) == 2
        error = capsys.readouterr().err.strip()
        assert error == (
            f"error: --resume: the run in {run_dir} was started with max_staleness=1, this config says {other}: "
            "resume with max_staleness=1, or start a new run in another output_dir"
        )
    # the steps stored ahead of the checkpoint are found by their shape: another one is refused as well
    groups = settings["groups_per_step"]
    config.write_text(yaml.safe_dump({**settings, "groups_per_step": groups + 1}))
    assert main(["train", str(config), "--resume", "--steps", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --resume: the asynchronous run in {run_dir} stored steps ahead of its checkpoint with "
        f"groups_per_step={groups}, this config says {groups + 1}: resume with groups_per_step={groups}, or start a "
        "new run in another output_dir"
    )
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_a_negative_staleness_is_one_clear_line(tmp_path: Path, capsys) -> None:
    config = tmp_path / "train.yaml"
    config.write_text(
        yaml.safe_dump(async_config(tmp_path / "run", max_staleness=0).model_dump(mode="json") | {"max_staleness": -1})
    )
    assert main(["train", str(config)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: invalid configuration:",
        "  max_staleness: Value error, max_staleness counts policy versions between the weights that sample a token "
        "and those that train on it: 0 or more, not -1 (leave it out for the synchronous loop)",
    ]
    assert not (tmp_path / "run").exists()


# --- the pieces ----------------------------------------------------------------------------------------------------
def _episode(*versions: int | None, start: int = 0) -> Trajectory:
    segments = [Segment("user", [1])] + [Segment("assistant", [2], policy_version=v) for v in versions]
    return Trajectory(segments=segments, policy_version=start, reward=0.0)


def test_a_groups_staleness_is_its_oldest_turns_and_groups_beyond_the_bound_are_dropped_and_counted() -> None:
    fresh = [_episode(3, 4), _episode(4)]
    old = [_episode(2, 4), _episode(4)]  # one turn of version 2: 2 versions stale at version 4
    unversioned = [_episode(None, start=3)]  # no turn says: the episode's start
    assert [group_staleness(g, 4) for g in (fresh, old, unversioned)] == [1, 2, 1]
    taken = within_bound([fresh, old, unversioned], version=4, max_staleness=1)
    assert taken.kept == [fresh, unversioned] and taken.staleness == [1, 1]
    assert taken.dropped == [old] and taken.every == [fresh, unversioned, old]
    # a turn of version 5 at version 4: weights this run never made (another trainer pushed to the server)
    future = [_episode(4, 5), _episode(4)]
    assert within_bound([fresh, future], version=4, max_staleness=1).dropped == [future]


def test_the_rollout_threads_sampler_stops_between_turns_and_the_gate_releases_its_waiter() -> None:
    class Inner:
        policy_version = 0

        def fork(self, prompt_ids: Any, n: int) -> list[int]:
            return list(range(n))

    stop, gate = threading.Event(), VersionGate(0)
    sampler = WorkerSampler(Inner(), stop)
    assert sampler.fork([1], 2) == [0, 1]
    stop.set()
    with pytest.raises(Stopped):
        sampler.fork([1], 2)
    waiter = threading.Thread(target=lambda: results.append(gate.wait_for(2)))
    results: list[bool] = []
    waiter.start()
    gate.publish_version(2)
    waiter.join(WAIT_S)
    assert results == [True]
    gate.close()
    assert gate.wait_for(5) is False  # closed: nobody waits for a version that will not come


def test_the_rollout_thread_samples_on_the_cuda_device_of_the_thread_that_made_it(monkeypatch) -> None:
    """The current CUDA device is a thread's own: under torchrun each rank's rollout thread would sample on GPU 0
    (a CUDA graph's capture synchronises the current device) unless it takes its rank's."""
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    gate = VersionGate(0)
    worker = RolloutWorker(lambda step: [], gate, range(1), max_staleness=0)
    worker.start()
    assert worker.get(0) == []
    worker.thread.join(WAIT_S)
    assert seen == [("longstraw-rollouts", 3)]


def test_a_step_whose_groups_were_all_dropped_stores_them_and_stops_naming_the_dp_rank() -> None:
    """Every rank raises alike (the writer says which dp ranks have nothing, to all): a rank that trained alone would
    wait for the others in its step's collectives."""
    from types import SimpleNamespace

    from longstraw_agents.app.async_rollouts import StepGroups
    from longstraw_agents.app.training import take_and_train

    stored: list[Trajectory] = []
    old = [_episode(1), _episode(1)]
    run = SimpleNamespace(
        ranks=SimpleNamespace(mesh=None, writes=True, from_writer=lambda obj: obj),
        store=SimpleNamespace(add_episodes=lambda episodes, run_id: stored.extend(episodes)),
        trainer=SimpleNamespace(policy_version=4),
        config=SimpleNamespace(max_staleness=1),
        run_id="run",
    )
    rollouts = SimpleNamespace(take=lambda step: StepGroups(kept=[], dropped=[old]))
    with pytest.raises(RuntimeError, match=r"^step 5: every group of dp rank 0 was sampled more than max_staleness=1"):
        take_and_train(run, 4, rollouts)  # type: ignore[arg-type]
    assert stored == old  # (stored before it stops: nothing lost)


# --- a served policy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "glm_moe_dsa"])
def test_a_sharded_policys_sampling_copy_takes_its_weights_by_name_lora_adapters_included(family: str) -> None:
    """Over FSDP2 the rollout thread's model is one of the policy's architecture whose weights ``publish`` copies
    in by name: with LoRA adapters, PEFT's names (``base_layer``, ``lora_A``...), and it then computes as the
    policy does."""
    from longstraw_agents.models.lora import LoraSpec, apply_lora
    from longstraw_agents.models.presets import TINY_PRESETS, build_model

    policy = apply_lora(build_model(TINY_PRESETS[family](), dtype=torch.float64), LoraSpec(r=4, alpha=8), init=False)
    copied = architecture_copy(policy, torch.float64)
    weights, into = publishable(policy), publishable(copied)
    assert into.keys() == weights.keys() and any(".lora_A." in name for name in into)
    with torch.no_grad():
        for name, tensor in into.items():
            tensor.copy_(weights[name])
        ids = torch.arange(12).unsqueeze(0)
        torch.testing.assert_close(copied(ids).logits, policy(ids).logits, rtol=0, atol=0)
    assert not any(p.requires_grad for p in copied.parameters())


@pytest.fixture
def server() -> Iterator[CompletionServer]:
    """A server of the runs' architecture (its first weights do not matter: an asynchronous run pushes its own)."""
    tokenizer = load_tokenizer()
    model = tiny_model("llama", vocab_size=tokenizer.vocab_size, hidden=32, layers=1).eval()
    with CompletionServer(TorchSampler(model, [tokenizer.eos_token_id]), model_name="tiny") as running:
        yield running


def served(run_dir: Path, server: CompletionServer, **updates: Any) -> TrainConfig:
    spec = {"base_url": server.url, "model": "tiny", "max_retries": 0}
    return async_config(run_dir, policy={"served": spec}, **updates)


def test_an_async_run_pushes_to_the_served_policy_while_it_samples(tmp_path: Path, server: CompletionServer) -> None:
    """Each turn records the version the server answered with, within the bound of the step that trained on it, and
    after the run the server holds the trainer's last weights."""
    train(served(tmp_path / "run", server, steps=2, max_staleness=1))
    for group_id, members in stored(tmp_path / "run").items():
        for t in members:
            versions = [s.policy_version for s in t.segments if s.role == "assistant"]
            assert all(v is not None and 0 <= t.info[TRAIN_VERSION] - v <= 1 for v in versions), group_id
    assert server.policy_version == 2
    served_now = {name: t.clone() for name, t in server.sampler.engine.model.state_dict().items()}
    assert_same_weights(served_now, checkpoint_weights(tmp_path / "run"))


def test_an_async_run_refuses_a_server_that_cannot_update_its_weights(
    tmp_path: Path, server: CompletionServer, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def no_route(self: CompletionServer, body: Any) -> dict[str, Any]:
        raise RequestError("no such route", status=404)

    monkeypatch.setattr(CompletionServer, "update_weights_from_disk", no_route)
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(served(tmp_path / "run", server, max_staleness=1).model_dump(mode="json")))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err  # (above it: the bar of transformers' save_pretrained, writing the push)
    assert err.count("error:") == 1
    said = err.strip().splitlines()[-1]
    assert said.startswith(
        "error: max_staleness: asynchronous GRPO loads each step's weights into the server while it samples, but "
        f"{server.url} cannot update its weights: {server.url}/update_weights_from_disk: no such endpoint "
        "(HTTP 404)"
    )
    assert not (tmp_path / "run" / "checkpoint").exists()  # no step ran: the same command runs once it is fixed


def test_a_served_sampler_of_an_async_run_refuses_completions_without_a_version() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        choice = {"token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "length"}
        return httpx.Response(200, json={"choices": [choice]})  # (vLLM: no metadata.weight_version)

    client = httpx.Client(transport=httpx.MockTransport(answer))
    sampler = OpenAISampler("http://server", [0], client=client, versioned=True)
    with pytest.raises(SamplerError, match="says with no completion which weights sampled it"):
        sampler.generate(sampler.fork([1, 2], 1)[0])
    plain = OpenAISampler("http://server", [0], client=client, policy_version=3)
    assert plain.generate(plain.fork([1, 2], 1)[0]).policy_version == 3  # synchronous: the version it was given


# --- on a mesh ------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
def test_an_async_run_on_two_fsdp_ranks_stores_each_group_once_and_resumes_from_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp=2 with FSDP2, launched by torchrun: each rank's rollout thread samples with weights assembled from the
    shards after every step, and the writer stores both ranks' groups of a step together. Resumed from the checkpoint
    of step 1 with step 2 stored, the writer sends each rank its stored groups of step 2: the uninterrupted run's
    weights again, nothing stored twice."""
    support = str(Path(coin_env.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [support, os.environ.get("PYTHONPATH")])))
    run_dir, config = tmp_path / "run", tmp_path / "train.yaml"
    env = {"id": f"coin_env:{coin_env.ENV_ID}", "kwargs": dict(coin_env.KWARGS)}
    settings = async_config(run_dir, steps=1, max_staleness=1).model_dump(mode="json")
    config.write_text(yaml.safe_dump(settings | {"env": env, "parallel": {"dp": 2, "fsdp": True}}))
    for extra in ((), ("--resume", "--steps", "2")):
        done = launch("torchrun", config, *extra, processes="2")
        assert done.returncode == 0, done.stderr[-3000:]
        if not extra:
            shutil.copytree(run_dir / "checkpoint", tmp_path / "checkpoint-1")
    groups = stored(run_dir)
    assert sorted(groups) == [f"step{s}-dp{r}-g0" for s in (1, 2) for r in (0, 1)]
    for group_id, members in groups.items():
        assert len(members) == 4
        for t in members:
            versions = [s.policy_version for s in t.segments if s.role == "assistant"]
            assert t.info[TRAIN_VERSION] == int(group_id[4]) - 1
            assert all(v is not None and 0 <= t.info[TRAIN_VERSION] - v <= 1 for v in versions), group_id
    lines = grpo_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    assert all(sum(line["finish_reasons"].values()) == 8 and line["groups_dropped_stale"] == 0 for line in lines)
    uninterrupted = checkpoint_weights(run_dir)

    shutil.rmtree(run_dir / "checkpoint")
    shutil.copytree(tmp_path / "checkpoint-1", run_dir / "checkpoint")
    again = launch("torchrun", config, "--resume", "--steps", "2", processes="2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_weights(checkpoint_weights(run_dir), uninterrupted)
    assert {k: len(v) for k, v in stored(run_dir).items()} == {k: len(v) for k, v in groups.items()}
