"""app/export.py through ``longstraw export RUN_DIR OUT``: a run's checkpoint as a Hugging Face directory — here a
one-process run's (``model.safetensors``); the FSDP2 run's sharded checkpoint is exported in
tests/app/test_distributed.py. A folder that is not a run fails with exit 2 and says why."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_runs import TINY_MODEL, checkpoint_weights, tiny_config
from transformers import AutoModelForCausalLM

from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.models.presets import tiny_model


def test_a_run_exports_the_weights_of_its_checkpoint(tmp_path: Path) -> None:
    # weight decay moves the weights even without a reward signal: the export differs from the policy's init
    trainer = {"group_size": 4, "lr": 1e-2, "weight_decay": 0.5}
    run_dir = train(tiny_config(tmp_path / "run", steps=1, groups_per_step=1, trainer=trainer))
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0  # longstraw export RUN_DIR OUT
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    saved = checkpoint_weights(run_dir)
    initial = tiny_model("llama", vocab_size=exported.config.vocab_size, seed=0, **TINY_MODEL["overrides"])
    assert not torch.equal(initial.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    names = [name for name, _ in exported.named_parameters()]
    assert set(names) <= set(saved)
    for name, param in exported.named_parameters():
        assert torch.equal(param, saved[name]), name


def test_exporting_a_folder_without_a_run_fails_clearly(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
