"""``weight_sync`` (SGLang's ``update_weights_from_disk`` protocol) against ``CompletionServer``: pushed weights are
served bit for bit with the version the trainer gave them, the sampler follows that version, and a directory of
another architecture, a missing path or a bad version is refused with a 400 that names the problem while the
served weights and version stay as they were."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from longstraw_agents.models.presets import build_model, tiny_llama
from longstraw_agents.parallel.fsdp import whole_parts
from longstraw_agents.sampler import OpenAISampler, SamplingConfig
from longstraw_agents.serving import CompletionServer
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.weight_sync import (
    DiskWeightSync,
    WeightSyncError,
    load_weights,
    save_weight_parts,
    save_weights,
)

STOP = 7
SHAPE = {"hidden": 32, "layers": 1}


def model(seed: int, heads: int | None = None, **overrides) -> torch.nn.Module:
    """A tiny llama; ``heads`` re-cuts its attention into other heads with every tensor shape kept."""
    config = tiny_llama(**{**SHAPE, **overrides})
    if heads is not None:
        width = config.num_attention_heads * config.head_dim
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, heads // 2, width // heads
    return build_model(config, seed=seed)


def assert_bit_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert not [name for name in sa if not torch.equal(sa[name], sb[name])]


@pytest.fixture
def server() -> Iterator[CompletionServer]:
    sampler = TorchSampler(model(seed=0), [STOP], SamplingConfig(max_new_tokens=4))
    with CompletionServer(sampler, model_name="tiny", model_path="/served/at/start") as running:
        yield running


def update(server: CompletionServer, body: object) -> httpx.Response:
    return httpx.post(server.url + "/update_weights_from_disk", json=body, timeout=60)


def test_save_weights_writes_a_whole_directory_that_loads_back_bit_equal(tmp_path: Path) -> None:
    trained, other = model(seed=1), model(seed=2)
    path = save_weights(trained, tmp_path / "v000001")
    save_weights(trained, path)  # a second save replaces the first
    assert {p.name for p in tmp_path.iterdir()} == {"v000001"}  # no temporary folder left behind
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    load_weights(other, path)
    assert_bit_equal(other, trained)


def test_weights_written_a_part_at_a_time_load_back_bit_equal(tmp_path: Path) -> None:
    """``whole_parts`` (here of an unsharded model: no gather) gives the root unit's tensors, then each decoder
    layer's; ``save_weight_parts`` writes one file per part and the index, which ``load_weights`` reads. A part that
    fails to write still lets every part be taken (on a mesh each is a collective)."""
    trained, other = model(seed=1), model(seed=2)
    parts = list(whole_parts(trained))
    assert len(parts) == trained.config.num_hidden_layers + 1
    assert all(name.startswith(f"model.layers.{i}.") for i, part in enumerate(parts[1:]) for name in part)
    path = save_weight_parts(trained, parts, tmp_path / "v000001")
    assert not (path / "model.safetensors").exists() and (path / "model.safetensors.index.json").is_file()
    load_weights(other, path)
    assert_bit_equal(other, trained)
    taken: list[int] = []

    def counted() -> Iterator[dict[str, torch.Tensor]]:
        for index, part in enumerate(whole_parts(trained)):
            taken.append(index)
            yield part if index != 1 else {"model.norm.weight": torch.zeros(2)}  # a name written twice: refused

    with pytest.raises(ValueError):
        save_weight_parts(trained, counted(), tmp_path / "v000002")
    assert taken == list(range(len(parts)))


def test_pushed_weights_are_served_bit_equal_with_their_version(server: CompletionServer, tmp_path: Path) -> None:
    sync = DiskWeightSync(server.url, tmp_path / "pushed")
    assert sync.served_version() == 0
    for version, seed in ((1, 11), (2, 12)):
        trained = model(seed=seed)
        result = sync.push(trained, version)
        assert result.version == version and result.path == tmp_path / "pushed" / f"v{version:06d}"
        assert_bit_equal(server.sampler.engine.model, trained)
        assert sync.served_version() == version == server.policy_version
    assert [p.name for p in (tmp_path / "pushed").iterdir()] == ["v000002"]  # keep=1: the older version is gone
    info = httpx.get(server.url + "/model_info", timeout=10).json()
    assert info["weight_version"] == "2" and info["model_path"] == str(result.path.resolve())
    assert httpx.get(server.url + "/get_weight_version", timeout=10).json() == {"weight_version": "2"}

    # the sampler records the version the server reports, and reads SGLang's token_ids
    remote = OpenAISampler(server.url, [STOP], SamplingConfig(max_new_tokens=4), model="tiny", policy_version=0)
    generations = remote.generate_batch(remote.fork([3, 4, 5], 3))
    assert remote.policy_version == 2 and remote.served_versions == {2}
    assert all(1 <= len(g.token_ids) <= 4 and len(g.logprobs) == len(g.token_ids) for g in generations)
    remote.close()
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": [3, 4], "max_tokens": 3, "logprobs": 1, "return_token_ids": True, "seed": 1},
        timeout=60,
    ).json()
    assert raw["metadata"] == {"weight_version": "2"}
    assert raw["choices"][0]["token_ids"] == [int(t.split(":")[1]) for t in raw["choices"][0]["logprobs"]["tokens"]]


def test_an_update_without_a_version_counts_up(server: CompletionServer, tmp_path: Path) -> None:
    path = save_weights(model(seed=3), tmp_path / "w")
    answer = update(server, {"model_path": str(path)})
    assert answer.status_code == 200 and answer.json()["success"] is True and answer.json()["weight_version"] == "1"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"hidden": 64}, ["hidden_size: 64 in the directory, 32 served", "model.embed_tokens.weight: shape"]),
        ({"heads": 2}, ["num_attention_heads"]),  # same tensor shapes, other heads: still another architecture
    ],
)
def test_another_architecture_is_refused_and_nothing_changes(
    server: CompletionServer, tmp_path: Path, overrides: dict, named: list[str]
) -> None:
    before = {name: t.clone() for name, t in server.sampler.engine.model.state_dict().items()}
    path = save_weights(model(seed=4, **overrides), tmp_path / "other")
    answer = update(server, {"model_path": str(path), "weight_version": "1"})
    assert answer.status_code == 400 and answer.json()["success"] is False
    message = answer.json()["message"]
    assert "not of the served model's architecture" in message and all(text in message for text in named), message
    assert server.policy_version == 0
    after = server.sampler.engine.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_missing_paths_and_bad_requests_are_refused_clearly(server: CompletionServer, tmp_path: Path) -> None:
    missing = update(server, {"model_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and "no directory at" in missing.json()["message"]
    (tmp_path / "empty").mkdir()
    empty = update(server, {"model_path": str(tmp_path / "empty")})
    assert empty.status_code == 400 and "has no config.json" in empty.json()["message"]
    path = save_weights(model(seed=5), tmp_path / "w")
    tagged = update(server, {"model_path": str(path), "weight_version": "step-3"})
    assert tagged.status_code == 400 and tagged.json()["message"].startswith("weight_version:")
    assert update(server, {"weight_version": "1"}).json()["message"].startswith("model_path:")
    assert server.policy_version == 0

    sync = DiskWeightSync(server.url, tmp_path / "pushed")
    with pytest.raises(WeightSyncError, match="not of the served model's architecture"):
        sync.push(model(seed=6, hidden=64), 1)
