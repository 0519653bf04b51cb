"""app/export.py through ``longstraw export RUN_DIR OUT``: a run's checkpoint and tokenizer as a Hugging Face
directory — here a one-process run's (``model.safetensors``); the FSDP2 run's sharded checkpoint is exported in
tests/app/test_distributed.py. A folder that is not a run, or an OUT that holds files (without ``--force``), fails
with exit 2 and says why."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_checkpoints import save_bpe_tokenizer
from tiny_runs import TINY_MODEL, checkpoint_weights, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstraw_agents.app.export import export_hf
from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.tokenizer import IM_END, IM_START, load_tokenizer


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
    # the run's tokenizer beside the weights, token for token (tests/test_tokenizer.py checks it on much more text)
    tokenizer, shipped = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True), load_tokenizer()
    text = f"{IM_START}user\nWhat is 12 + 7?{IM_END}\n{IM_START}assistant\n<tool_call>{{}}</tool_call>  \n"
    assert tokenizer.encode(text, add_special_tokens=False) == shipped.encode(text, allow_special=True)
    assert tokenizer.decode(shipped.encode(text, allow_special=True)) == text


def test_export_refuses_a_directory_that_holds_files_unless_forced(tmp_path: Path, capsys) -> None:
    run_dir = train(tiny_config(tmp_path / "run", steps=1, groups_per_step=1, trainer={"group_size": 2}))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} is not empty (notes.txt)") and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written
    assert main(["export", str(run_dir), str(out), "--force"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "notes.txt"} <= {p.name for p in out.iterdir()}
    assert main(["export", str(run_dir), str(tmp_path / "hf" / "notes.txt")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_run_on_a_hugging_face_tokenizer_exports_that_tokenizer(tmp_path: Path) -> None:
    source = save_bpe_tokenizer(tmp_path / "tokenizer")
    config = tiny_config(tmp_path / "run", steps=1, groups_per_step=1, trainer={"group_size": 2}, tokenizer=str(source))
    export_hf(train(config), tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    original = AutoTokenizer.from_pretrained(source, local_files_only=True)
    assert exported.get_vocab() == original.get_vocab() and exported.eos_token == original.eos_token == IM_END
    text = f"{IM_START}user\nWhat is 3 * 4?{IM_END}"
    assert exported.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)


def test_exporting_a_folder_without_a_run_fails_clearly(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
