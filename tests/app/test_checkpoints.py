"""Real checkpoints through the CLI: a model and a tokenizer saved with ``save_pretrained`` (the tokenizer a BPE
trained here with the ``tokenizers`` library) are trained from ``model: {path: DIR}`` / ``tokenizer: DIR``, then
replayed and inspected. (Configs such checkpoints cannot serve fail earlier: tests/app/test_config.py.)"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml
from hf_checkpoints import save_bpe_tokenizer, save_tiny_llama
from safetensors.torch import load_file
from tiny_runs import WARM_START, checkpoint_weights, tiny_config_dict

from longstraw_agents.cli import main
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import IM_START, load_tokenizer

G, GROUPS, STEPS = 4, 4, 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tokenizer directory and a random-init model directory whose vocabulary is the tokenizer's."""
    root = tmp_path_factory.mktemp("checkpoint")
    tokenizer = save_bpe_tokenizer(root / "tokenizer")
    return save_tiny_llama(root / "model", load_tokenizer(tokenizer).vocab_size), tokenizer


def cli(*args: str | Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def trained(saved: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``longstraw train`` from the saved directories: a warm start on scripted episodes, then 2 GRPO steps."""
    model, tokenizer = saved
    root = tmp_path_factory.mktemp("trained")
    config = tiny_config_dict(
        root / "run",
        model={"path": str(model)},  # no preset: a path alone is a complete model setting
        tokenizer=str(tokenizer),
        warm_start=WARM_START,
        groups_per_step=GROUPS,
        steps=STEPS,
    )
    (root / "train.yaml").write_text(yaml.safe_dump(config))
    code, out = cli("train", root / "train.yaml")
    assert code == 0, out
    return root / "run"


def test_training_from_saved_directories_uses_their_model_and_tokenizer(saved, trained: Path) -> None:
    model, tokenizer = saved
    hf = load_tokenizer(tokenizer)
    assert hf.vocab_size < load_tokenizer("longstraw-bpe").vocab_size  # not the shipped BPE in disguise
    with Store.open(trained / "trajectories.db", create=False) as store:
        [run] = store.runs()
        assert (run.model, run.tokenizer) == (str(model), str(tokenizer))
        episodes = list(store.episodes())
    assert len(episodes) == STEPS * GROUPS * G
    for trajectory in episodes:
        # the envs rendered their prompts with the saved tokenizer (not the shipped BPE), and every stored id is one
        # of its ids and decodes to the stored text
        assert trajectory.segments[0].token_ids[0] == hf.special_token_id(IM_START)
        for segment in trajectory:
            assert segment.token_ids.max(initial=0) < hf.vocab_size and hf.decode(segment.token_ids) == segment.text
    start, trained_weights = load_file(model / "model.safetensors"), checkpoint_weights(trained)
    assert start.keys() == trained_weights.keys()
    assert any(not trained_weights[name].equal(start[name]) for name in start)


def test_replay_and_inspect_a_run_of_saved_directories(trained: Path, tmp_path: Path) -> None:
    with Store.open(trained / "trajectories.db", create=False) as store:
        mixed = [g for g, members in store.groups().items() if len({t.reward for t in members}) > 1]
    assert mixed, "no group has mixed rewards after the warm start: replay would have nothing to train on"
    code, out = cli("replay", trained / "trajectories.db", "--where", "reward >= 0", "--out", tmp_path / "replay")
    assert code == 0, out
    [selected, *steps] = [json.loads(line) for line in (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert selected["policy_source"] == "checkpoint" and selected["groups_trained"] == len(mixed)
    assert [step["policy_version"] for step in steps] == [STEPS + 1]

    code, out = cli("inspect", trained / "trajectories.db", "--group", "step2-g0", "--max-text", "0")
    assert code == 0 and out.startswith(f"group step2-g0: {G} episodes, reward ")
    assert "<|im_start|>system" in out and '"name": "calculator"' in out
