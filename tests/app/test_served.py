"""A served policy (app/served.py, ``policy.served``): ``train()`` samples from a ``CompletionServer`` that holds its
own copy of the policy and pushes the trainer's weights to it after every optimizer step (SGLang's
``update_weights_from_disk``). After each step the served weights equal the trainer's bit for bit, and every stored
episode carries the version that was served when it was sampled."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from launches import launch
from tiny_runs import assert_same_weights, checkpoint_weights, tiny_config, tiny_config_dict, warm_started_policy
from transformers import AutoModelForCausalLM

from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.run import Run
from longstraw_agents.app.served import ServedPolicy
from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.sampler import SamplerError, SamplingConfig
from longstraw_agents.serving import CompletionServer
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.weight_sync import save_weights

NAME = "tiny-served"


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warm_started_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture
def server(policy: Path) -> Iterator[CompletionServer]:
    """The server's own copy of the policy, loaded from the checkpoint the trainer starts from."""
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, local_files_only=True).eval()
    sampler = TorchSampler(model, [load_tokenizer().eos_token_id], SamplingConfig())
    with CompletionServer(sampler, model_name=NAME, model_path=str(policy)) as running:
        yield running


def served_config(run_dir: Path, policy: Path, server: CompletionServer | None, steps: int) -> TrainConfig:
    """Weight decay moves every weight at every step, also in a step whose groups all scored alike (zero
    advantages): the weights the server must take differ from step to step whatever the rewards."""
    served = {"base_url": server.url if server else "http://127.0.0.1:9", "model": NAME, "max_retries": 0}
    trainer = {"group_size": 4, "lr": 1e-3, "weight_decay": 0.1}
    model = {"preset": None, "path": str(policy)}
    return tiny_config(run_dir, model=model, steps=steps, trainer=trainer, policy={"served": served})


def served_weights(server: CompletionServer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in server.sampler.engine.model.state_dict().items()}


def stored_versions(run_dir: Path) -> dict[str, set[int]]:
    """The policy versions of the stored episodes, by step (group ids ``step{k}-g{i}``)."""
    versions: dict[str, set[int]] = {}
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        for episode in store.episodes():
            versions.setdefault(episode.group_id.split("-")[0], set()).add(episode.policy_version)
    return versions


def test_two_steps_against_a_served_policy(
    tmp_path: Path, policy: Path, server: CompletionServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    pushed: list[tuple[int, dict[str, torch.Tensor]]] = []
    push = Run.push_weights

    def push_and_compare(run: Run) -> None:  # right after each optimizer step's push: served == trainer's
        push(run)
        trainer = run.trainer.engine.model.state_dict()
        assert_same_weights(served_weights(server), trainer)
        pushed.append((server.policy_version, {name: t.clone() for name, t in trainer.items()}))

    monkeypatch.setattr(Run, "push_weights", push_and_compare)
    initial = served_weights(server)
    train(served_config(run_dir, policy, server, steps=2))  # version 0 served from model.path: no push before
    assert [version for version, _ in pushed] == [1, 2]
    first, second = pushed[0][1], pushed[1][1]
    assert any(not torch.equal(initial[n], first[n]) for n in initial)
    assert any(not torch.equal(first[n], second[n]) for n in first)
    assert_same_weights(served_weights(server), checkpoint_weights(run_dir))
    assert stored_versions(run_dir) == {"step1": {0}, "step2": {1}}
    assert [p.name for p in (run_dir / "served_weights").iterdir()] == ["v000002"]  # keep: 1

    train(served_config(run_dir, policy, server, steps=3), resume=True)  # resumed: the server serves version 2 already
    assert [version for version, _ in pushed] == [1, 2, 3]
    assert_same_weights(served_weights(server), checkpoint_weights(run_dir))
    assert stored_versions(run_dir) == {"step1": {0}, "step2": {1}, "step3": {2}}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_mesh_trains_a_served_policy(tmp_path: Path, policy: Path, server: CompletionServer) -> None:
    """dp 1 x cp 2 with FSDP2 (``longstraw train`` under torchrun): after each step the writer pushes the weights
    assembled a part at a time from the shards (the other rank joining each part's gathers: no device holds the
    whole model), the server then serves the run's weights bit for bit, and the first cp rank samples from it."""
    run_dir = tmp_path / "run"
    served = {"base_url": server.url, "model": NAME, "max_retries": 0}
    settings = tiny_config_dict(run_dir, model={"preset": None, "path": str(policy)}, policy={"served": served})
    settings["trainer"] = {**settings["trainer"], "group_size": 4, "lr": 1e-3, "weight_decay": 0.1}
    settings["parallel"] = {"dp": 1, "cp": 2, "fsdp": True}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(settings))
    done = launch("torchrun", config, processes="2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert server.policy_version == 2
    assert_same_weights(served_weights(server), checkpoint_weights(run_dir))
    assert stored_versions(run_dir) == {"step1": {0}, "step2": {1}}
    pushed = run_dir / "served_weights" / "v000002"
    parts = set(json.loads((pushed / "model.safetensors.index.json").read_text())["weight_map"].values())
    layers = server.sampler.engine.model.config.num_hidden_layers
    assert len(parts) == layers + 1  # the root unit's tensors, then each decoder layer's


def test_changed_weights_are_pushed_before_the_first_sampling(tmp_path: Path, server: CompletionServer) -> None:
    """A warm start changes the weights without a new version: the server, though at version 0, gets them first."""
    trainer_model = AutoModelForCausalLM.from_pretrained(server.model_path, local_files_only=True)
    with torch.no_grad():
        trainer_model.lm_head.weight.add_(1.0)
    spec = served_config(tmp_path, Path(server.model_path), server, 1).policy.served
    assert spec is not None
    unchanged = ServedPolicy(spec, tmp_path / "a")
    unchanged.sampler(trainer_model, 0, [2], SamplingConfig())
    assert not (tmp_path / "a" / "served_weights").exists()  # version 0 served already: nothing pushed

    changed = ServedPolicy(spec, tmp_path / "b", weights_changed=True)
    sampler = changed.sampler(trainer_model, 0, [2], SamplingConfig(max_new_tokens=2))
    assert_same_weights(served_weights(server), trainer_model.state_dict())
    assert server.policy_version == 0 and (tmp_path / "b" / "served_weights" / "v000000").is_dir()

    # something else loads other weights into the server mid-rollout: the rollout fails before anything trains on it
    other = save_weights(trainer_model, tmp_path / "elsewhere")
    httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(other), "weight_version": "7"})
    with pytest.raises(SamplerError, match="answered with weight version 7, not 0"):
        sampler.generate(sampler.fork([5, 6], 1)[0])
    changed.close()
    unchanged.close()


def test_an_unreachable_server_ends_the_cli_run_with_a_clear_error(tmp_path: Path, policy: Path, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    config = served_config(tmp_path / "run", policy, server=None, steps=1).model_dump(mode="json")
    config["policy"]["served"]["base_url"] = closed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"error: {closed} is unreachable (ConnectError" in err and "--resume" in err
