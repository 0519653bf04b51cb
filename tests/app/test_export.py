"""app/export.py: a run's checkpoint as a Hugging Face directory — here a one-process run's (``model.safetensors``);
the FSDP2 run's sharded checkpoint is exported in tests/app/test_distributed.py."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_runs import TINY_MODEL, checkpoint_weights, tiny_config
from transformers import AutoModelForCausalLM

from longstraw_agents.app.export import export_hf
from longstraw_agents.app.training import train
from longstraw_agents.models.presets import tiny_model


def test_a_run_exports_the_weights_of_its_checkpoint(tmp_path: Path) -> None:
    # weight decay moves the weights even without a reward signal: the export differs from the policy's init
    trainer = {"group_size": 4, "lr": 1e-2, "weight_decay": 0.5}
    run_dir = train(tiny_config(tmp_path / "run", steps=1, groups_per_step=1, trainer=trainer))
    exported = AutoModelForCausalLM.from_pretrained(export_hf(run_dir, tmp_path / "hf"))
    saved = checkpoint_weights(run_dir)
    initial = tiny_model("llama", vocab_size=exported.config.vocab_size, seed=0, **TINY_MODEL["overrides"])
    assert not torch.equal(initial.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    names = [name for name, _ in exported.named_parameters()]
    assert set(names) <= set(saved)
    for name, param in exported.named_parameters():
        assert torch.equal(param, saved[name]), name
