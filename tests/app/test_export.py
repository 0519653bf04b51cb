"""app/export.py through ``longstraw export RUN_DIR OUT``: a run's checkpoint and tokenizer as a Hugging Face
directory that transformers users can chat with — here a one-process run's (``model.safetensors``); the FSDP2 run's
sharded checkpoint is exported in tests/app/test_distributed.py. The export stops ``generate`` at the end of a turn,
and its tokenizer decodes and re-encodes every stored segment of the run to its ids. A folder that is not a run, or
an OUT that holds files (without ``--force``), fails with exit 2 and says why. One tiny run serves the module."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import save_bpe_tokenizer
from tiny_runs import TINY_MODEL, checkpoint_weights, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from longstraw_agents.app.export import export_hf, quiet_transformers
from longstraw_agents.app.training import train
from longstraw_agents.cli import main
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import (
    CONTROL_TOKENS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TAG_TOKENS,
    Tokenizer,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # weight decay moves the weights even without a reward signal: the export differs from the policy's init
    trainer = {"group_size": 4, "lr": 1e-2, "weight_decay": 0.5}
    return train(tiny_config(tmp_path_factory.mktemp("run"), steps=1, groups_per_step=1, trainer=trainer))


@pytest.fixture(scope="module")
def exported(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(run_dir, tmp_path_factory.mktemp("export") / "hf")


def test_a_run_exports_the_weights_of_its_checkpoint(run_dir: Path, exported: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(exported)
    saved = checkpoint_weights(run_dir)
    initial = tiny_model("llama", vocab_size=model.config.vocab_size, seed=0, **TINY_MODEL["overrides"])
    assert not torch.equal(initial.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    names = [name for name, _ in model.named_parameters()]
    assert set(names) <= set(saved)
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[name]), name
    # the run's tokenizer beside the weights, token for token (tests/test_tokenizer.py checks it on much more text)
    tokenizer, shipped = AutoTokenizer.from_pretrained(exported, local_files_only=True), load_tokenizer()
    text = f"{IM_START}user\nWhat is 12 + 7?{IM_END}\n{IM_START}assistant\n<tool_call>{{}}</tool_call>  \n"
    assert tokenizer.encode(text, add_special_tokens=False) == shipped.encode(text, allow_special=True)
    assert tokenizer.decode(shipped.encode(text, allow_special=True)) == text


def test_export_prints_one_line_and_refuses_a_directory_that_holds_files_unless_forced(
    run_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run_dir), str(out)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: {out} is not empty (notes.txt)") and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written
    assert main(["export", str(run_dir), str(out), "--force"]) == 0
    # nothing of transformers' (its "Writing model shards" bar, its warnings): the command's own line only
    assert capfd.readouterr() == (f"Hugging Face model directory: {out}\n", "")
    assert transformers_logging.is_progress_bar_enabled()  # restored for whoever imports the function
    written = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    assert written | {"notes.txt"} <= {p.name for p in out.iterdir()}
    assert main(["export", str(run_dir), str(tmp_path / "hf" / "notes.txt")]) == 2
    assert "is a file" in capfd.readouterr().err


def test_quiet_transformers_silences_transformers_only_and_restores_its_settings() -> None:
    verbosity = transformers_logging.get_verbosity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_transformers():
            assert not transformers_logging.is_progress_bar_enabled()
            assert transformers_logging.get_verbosity() == transformers_logging.ERROR
            warnings.warn_explicit("noise", UserWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
            warnings.warn_explicit("ours", UserWarning, "export.py", 1, module="longstraw_agents.app.export")
    assert [str(warning.message) for warning in caught] == ["ours"]
    assert transformers_logging.is_progress_bar_enabled() and transformers_logging.get_verbosity() == verbosity


def rig_bigrams(model: Any, successors: dict[int, int]) -> None:
    """Make a one-layer Llama a bigram machine: after each token of ``successors`` it writes that token's successor
    with a logit of about 5.7 against 0 for every other token, whatever came before. The layer's outputs are zeroed,
    so the last hidden state is the token's embedding, here a unit vector of its own per token."""
    assert not model.config.tie_word_embeddings and len(successors) <= model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for k, (token, successor) in enumerate(successors.items()):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(
                torch.tensor(k), model.config.hidden_size
            )
            model.lm_head.weight[successor, k] = 1.0


def test_generate_on_the_export_stops_at_the_end_of_the_turn(exported: Path) -> None:
    shipped = load_tokenizer()
    end_of_turn, end_of_text = shipped.eos_token_id, shipped.special_token_id(ENDOFTEXT)
    config = json.loads((exported / "config.json").read_text())
    generation = json.loads((exported / "generation_config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (end_of_turn, end_of_text, None)
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([end_of_turn, end_of_text], end_of_text)

    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"]
    reply = tokenizer.encode(f"<answer>5</answer>{IM_END}", add_special_tokens=False)
    assert reply[-1] == end_of_turn
    # after the prompt, the reply; after the reply's <|im_end|>, the reply again: only eos ends the generation
    chain = [int(prompt[0, -1]), *reply]
    assert len(set(chain)) == len(chain)
    rig_bigrams(model, {**dict(zip(chain, chain[1:], strict=False)), end_of_turn: reply[0]})
    generated = model.generate(prompt, max_new_tokens=3 * len(reply), do_sample=False)[0, prompt.shape[1] :]
    assert generated.tolist() == reply
    assert tokenizer.decode(generated, skip_special_tokens=True) == "<answer>5</answer>"  # the tags are not special


def assert_round_trips(run_dir: Path, exported: Path, run_tokenizer: Tokenizer) -> dict[str, int]:
    """Every stored segment of the run decodes with the exported tokenizer to its text, and the text re-encodes to
    its ids: exactly for what the environment encoded, and for what the policy sampled (which may be a tokenisation
    the BPE would not choose) as the run's own tokenizer re-encodes it. Returns the segments checked by role."""
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    with Store.open(run_dir / "trajectories.db", create=False) as store:
        segments = [segment for episode in store.episodes() for segment in episode.segments]
    checked: dict[str, int] = {}
    for segment in segments:
        ids = segment.token_ids.tolist()
        text = tokenizer.decode(ids)
        assert text == segment.text
        reencoded = tokenizer.encode(text, add_special_tokens=False)
        if segment.role == "assistant":
            assert reencoded == run_tokenizer.encode(text, allow_special=True), text
        else:
            assert reencoded == ids, text
        checked[segment.role] = checked.get(segment.role, 0) + 1
    return checked


def test_every_stored_segment_round_trips_through_the_exported_tokenizer(run_dir: Path, exported: Path) -> None:
    checked = assert_round_trips(run_dir, exported, load_tokenizer())
    assert checked["system"] == 4 and checked["assistant"] >= 4 and checked["user"] >= 4  # 1 group of 4


def test_a_run_on_a_hugging_face_tokenizer_exports_that_tokenizer(tmp_path: Path) -> None:
    # a tokenizer as Qwen's: the ChatML tokens special, the tags added tokens that are not
    source = save_bpe_tokenizer(tmp_path / "tokenizer", special_tokens=CONTROL_TOKENS, tags=TAG_TOKENS)
    config = tiny_config(tmp_path / "run", steps=1, groups_per_step=1, trainer={"group_size": 2}, tokenizer=str(source))
    run_dir = train(config)
    export_hf(run_dir, tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    original = AutoTokenizer.from_pretrained(source, local_files_only=True)
    assert exported.get_vocab() == original.get_vocab() and exported.eos_token == original.eos_token == IM_END
    text = f"{IM_START}user\nWhat is 3 * 4?{IM_END}"
    assert exported.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert original.chat_template is None and exported.chat_template is not None
    assert assert_round_trips(run_dir, tmp_path / "hf", load_tokenizer(str(source)))["system"] == 2
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [original.convert_tokens_to_ids(t) for t in (IM_END, ENDOFTEXT)]


def test_exporting_a_folder_without_a_run_fails_clearly(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_the_readme_snippet_chats_with_an_export(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    [snippet] = [block for block in blocks if "AutoModelForCausalLM.from_pretrained(" in block]
    assert len([line for line in snippet.splitlines() if line]) == 5
    exec(snippet.replace('"hf-out"', repr(str(exported))), {})  # the README's own lines, on this module's export
    printed = capsys.readouterr().out
    assert printed.strip()  # the tiny policy's reply, whatever it says
