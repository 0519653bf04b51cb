"""A LoRA run through the CLI (``model.lora``, examples/train_calculator_lora.yaml at a tiny size): ``longstraw train``
trains the adapters only, ``--resume`` continues from the adapters' checkpoint and refuses other LoRA settings in one
line, ``longstraw export`` writes the adapter in PEFT's format (``--merged``: the merged model), ``longstraw serve``'s
loader serves the policy with the adapter merged in, and a served policy is pushed the merged weights.

One run of 2 steps (a short warm start trains the adapters, so that they act) serves the module: about 10 s."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from longstraw_agents.app.config import ServedPolicySpec, TrainConfig, load_config
from longstraw_agents.app.export import load_run_policy
from longstraw_agents.app.serve import load_policy
from longstraw_agents.app.served import ServedPolicy
from longstraw_agents.cli import main
from longstraw_agents.models.lora import LoraSpec, apply_lora, lora_layers, merged_copy
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.serving import CompletionServer
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_calculator_lora.yaml"
TINY = {"hidden": 32, "layers": 4}  # qwen3_5: three GatedDeltaNet layers and a gated attention layer


def tiny_settings(output_dir: Path, steps: int) -> dict:
    """The example at a tiny size: every LoRA setting as it ships, the model, the run and the warm start shrunk."""
    settings = yaml.safe_load(EXAMPLE.read_text())
    settings["model"]["overrides"] = TINY
    settings["trainer"].update(G=4, chunk_size=64)
    settings["warm_start"] = {"episodes": 8, "sft": {"steps": 12, "batch_size": 2, "lr": 3e-2}}
    settings["env"]["kwargs"]["max_turns"] = 1
    settings["sampling"]["max_new_tokens"] = 16
    return {**settings, "groups_per_step": 1, "steps": steps, "eval_episodes": 0, "checkpoint_every": 1,
            "output_dir": str(output_dir), "progress": False}  # fmt: skip


def write(settings: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step, then ``--resume`` to the second."""
    root = tmp_path_factory.mktemp("lora")
    run = root / "run"
    assert main(["train", str(write(tiny_settings(run, steps=1), root / "one.yaml"))]) == 0
    assert main(["train", "--resume", str(write(tiny_settings(run, steps=2), root / "two.yaml"))]) == 0
    return run


def test_the_example_validates_as_shipped():
    config = load_config(EXAMPLE)
    assert config.model.lora == LoraSpec(r=16, alpha=32, target_modules="all-linear", dropout=0.0)
    assert config.trainer.mode == "exact" and config.model.preset == "qwen3_5"


def test_a_lora_run_trains_and_resumes_the_adapters_only(run_dir: Path):
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in steps if line["phase"] == "grpo"] == [1, 2]
    saved = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert saved["step"] == 2 and saved["lora"]["r"] == 16
    policy = load_run_policy(run_dir).model
    config = TrainConfig.model_validate_json((run_dir / "config.json").read_text())
    base = tiny_model("qwen3_5", vocab_size=policy.config.vocab_size, **TINY)
    frozen = {n: p for n, p in policy.named_parameters() if not p.requires_grad}
    assert all(torch.equal(p, base.get_parameter(n.replace(".base_layer", ""))) for n, p in frozen.items())
    adapters = [p for n, p in policy.named_parameters() if p.requires_grad]
    assert adapters and all(p.abs().max() > 0 for p in adapters)  # B trained away from 0 (by the warm start)
    assert config.model.lora is not None and len(lora_layers(policy)) == 3 * 5 + 4 + 4 * 3  # GDN, attention, MLPs


def test_a_resume_with_other_lora_settings_fails_in_one_line(run_dir: Path, tmp_path: Path, capsys):
    settings = tiny_settings(run_dir, steps=3)
    settings["model"]["lora"]["r"] = 8
    assert main(["train", "--resume", str(write(settings, tmp_path / "other.yaml"))]) == 2
    err = capsys.readouterr().err.strip()
    assert "LoRA settings (r=16" in err and "differ from the model's (r=8" in err
    assert len(err.splitlines()) == 1


def test_export_writes_the_adapter_in_peft_format_and_the_merged_model(run_dir: Path, tmp_path: Path):
    policy = load_run_policy(run_dir).model
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        expected = policy(ids).logits

    assert main(["export", str(run_dir), str(tmp_path / "adapter")]) == 0
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    base = tiny_model("qwen3_5", vocab_size=policy.config.vocab_size, **TINY)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, rtol=0, atol=1e-5)

    assert main(["export", "--merged", str(run_dir), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert not lora_layers(merged)
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_serve_loads_the_run_with_its_adapter_merged(run_dir: Path):
    served = load_policy(run_dir, device="cpu")
    assert not lora_layers(served.model) and "LoRA merged" in served.source
    policy = load_run_policy(run_dir).model
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(served.model(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)


def test_a_served_policy_is_pushed_the_merged_weights(tmp_path: Path):
    """The disk protocol loads whole models: a LoRA policy reaches the server merged, under transformers' names."""
    base = tiny_model("llama", hidden=32, layers=1)
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    policy = apply_lora(copy.deepcopy(base), LoraSpec(r=2, target_modules=["q_proj", "lm_head"]), init=False)
    sampler = TorchSampler(copy.deepcopy(base), [load_tokenizer().eos_token_id], SamplingConfig())
    with CompletionServer(sampler, model_name="lora", model_path=str(tmp_path / "base")) as server:
        spec = ServedPolicySpec(base_url=server.url, model="lora", max_retries=0)
        served = ServedPolicy(spec, tmp_path / "run", weights_changed=True)
        served.sampler(policy, 0, [2], SamplingConfig(max_new_tokens=2))
        expected = merged_copy(policy).state_dict()
        got = server.sampler.engine.model.state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)
        assert any(not torch.equal(got[name], base.state_dict()[name]) for name in expected)
        served.close()


def test_check_injects_the_adapters_on_the_meta_device(tmp_path: Path, capsys):
    """``longstraw train --check``: the adapters the run would train, counted without weights; a target that matches
    nothing is one line naming model.lora, before anything is written."""
    settings = tiny_settings(tmp_path / "run", steps=1)
    assert main(["train", "--check", str(write(settings, tmp_path / "ok.yaml"))]) == 0
    assert "r=16, alpha 32: " in capsys.readouterr().out
    settings["model"]["lora"]["target_modules"] = ["q_proj", "qkv"]
    assert main(["train", "--check", str(write(settings, tmp_path / "bad.yaml"))]) == 2
    err = capsys.readouterr().err
    assert "model.lora.target_modules: 'qkv' matches no module" in err
    assert not (tmp_path / "run").exists()
