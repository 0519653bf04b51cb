"""The training configuration (``app.config``): field-named validation errors, strict numbers, YAML and TOML alike,
and the checks that need more than the file (env, tokenizer, model) failing before anything is written."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch
import yaml
from hf_checkpoints import save_bpe_tokenizer, save_tiny_llama
from paths import REPO
from tiny_runs import ENV_ID, tiny_config, tiny_config_dict
from transformers import LlamaConfig

from longstraw_agents.app.config import (
    ConfigError,
    ModelSpec,
    ParallelSpec,
    TrainConfig,
    WarmStartSpec,
    check_env,
    check_model,
    load_config,
    validation_lines,
)
from longstraw_agents.app.run import build_policy
from longstraw_agents.app.training import train
from longstraw_agents.tokenizer import ENDOFTEXT, load_tokenizer


@pytest.mark.parametrize(
    ("update", "location"),
    [
        ({"groups_per_step": 0}, ("groups_per_step",)),
        ({"trainer": {"group_size": 0}}, ("trainer", "group_size")),
        ({"sampling": {"temperature": -1.0}}, ("sampling", "temperature")),
        ({"stepz": 3}, ("stepz",)),
        ({"env": {"kwargs": {}}}, ("env", "id")),
    ],
)
def test_invalid_configs_name_the_field(update: dict, location: tuple[str, ...]) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        TrainConfig.model_validate(tiny_config_dict("runs/x", **update))
    assert [e["loc"] for e in err.value.errors()] == [location]


def test_a_model_is_a_preset_or_a_path() -> None:
    with pytest.raises(pydantic.ValidationError, match="exactly one of model.preset and model.path"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", model={"preset": "llama", "path": "/models/x"}))
    with pytest.raises(pydantic.ValidationError, match="exactly one of model.preset and model.path"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", model={"preset": None}))
    with pytest.raises(pydantic.ValidationError, match="overrides are preset arguments"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", model={"path": "/models/x", "overrides": {"layers": 2}}))


def test_an_unknown_key_gets_the_closest_key_its_section_takes() -> None:
    typos = tiny_config_dict(
        "runs/x",
        stepz=3,
        zzzzzz=1,
        trainer={"lrr": 0.1, "num_generation": 4, "loss": {"betaa": 0.1}},
        sampling={"temprature": 1.0},
        parallel={"dpp": 2},
        warm_start={"episods": 3},
    )
    with pytest.raises(pydantic.ValidationError) as err:
        TrainConfig.model_validate(typos)
    lines = validation_lines(err.value, schema=TrainConfig).splitlines()
    suggested = {
        "stepz": "steps",
        "trainer.lrr": "lr",  # the trainer takes optimizer and loss settings flat, and TRL's names
        "trainer.num_generation": "num_generations",
        "trainer.loss.betaa": "beta",
        "sampling.temprature": "temperature",
        "parallel.dpp": "dp",
        "warm_start.episods": "episodes",
    }
    for location, key in suggested.items():
        assert f"  {location}: Extra inputs are not permitted; did you mean {key!r}?" in lines
    assert "  zzzzzz: Extra inputs are not permitted" in lines  # nothing close: no guess
    assert "did you mean" not in validation_lines(err.value)  # no schema given: nothing to guess from


def test_a_model_path_alone_is_a_complete_model_setting(tmp_path: Path) -> None:
    """``model: {path: DIR}`` is a whole model setting: ``preset`` defaults to llama only when no path is given."""
    assert ModelSpec(path="/models/x").preset is None
    assert ModelSpec().preset == "llama" and ModelSpec(overrides={"hidden": 32}).preset == "llama"
    (tmp_path / "train.yaml").write_text(f"env: {{id: {ENV_ID}}}\nmodel: {{path: /models/x}}\n")
    config = load_config(tmp_path / "train.yaml")
    assert (config.model.path, config.model.preset) == ("/models/x", None)
    assert TrainConfig.model_validate_json(config.model_dump_json()) == config  # config.json reads back


@pytest.mark.parametrize(
    ("setting", "location"),
    [
        ("steps: '3'", "steps"),
        ("groups_per_step: '2'", "groups_per_step"),
        ("eval_episodes: '4'", "eval_episodes"),
        ("checkpoint_every: '1'", "checkpoint_every"),
        ("seed: '7'", "seed"),
        ("steps: 3.0", "steps"),
        ("steps: true", "steps"),
        ("model: {max_context: '64'}", "model.max_context"),
        ("warm_start: {episodes: '8'}", "warm_start.episodes"),
        ("trainer: {lr: '0.001'}", "trainer.optim.lr"),
        ("trainer: {loss: {beta: '0.1'}}", "trainer.loss.beta"),
        ("trainer: {track_memory: 'no'}", "trainer.track_memory"),
        ("trainer: {group_size: '4'}", "trainer.group_size"),
        ("sampling: {max_new_tokens: '24'}", "sampling.max_new_tokens"),
        ("progress: 'no'", "progress"),
    ],
)
def test_a_string_is_no_number(tmp_path: Path, setting: str, location: str) -> None:
    """A quoted number is not coerced (``steps: "3"`` would silently run 3 steps): the error names the field."""
    (tmp_path / "train.yaml").write_text(f"env: {{id: {ENV_ID}}}\n{setting}\n")
    with pytest.raises(pydantic.ValidationError) as err:
        load_config(tmp_path / "train.yaml")
    assert [".".join(map(str, e["loc"])) for e in err.value.errors()] == [location]


def test_strict_numbers_still_read_what_config_files_hold(tmp_path: Path) -> None:
    """YAML's ``2e-4`` (a string to PyYAML), an int where a float goes, a list for AdamW's betas tuple, TOML's
    numbers: all read as the numbers they are. Python callers get the same strictness for the run's own fields."""
    (tmp_path / "train.yaml").write_text(
        f"env: {{id: {ENV_ID}}}\nsteps: 3\ntrainer: {{lr: 2e-4, epsilon: 1, betas: [0.9, 0.95]}}\n"
        "sampling: {temperature: 1, top_p: .9}\n"
    )
    config = load_config(tmp_path / "train.yaml")
    assert config.steps == 3 and config.trainer.optim.lr == 2e-4 and config.trainer.optim.betas == (0.9, 0.95)
    assert config.trainer.loss.epsilon == 1.0 and config.sampling.top_p == 0.9
    (tmp_path / "train.toml").write_text(f'steps = "3"\n[env]\nid = "{ENV_ID}"\n')
    with pytest.raises(pydantic.ValidationError, match="steps"):
        load_config(tmp_path / "train.toml")
    (tmp_path / "date.toml").write_text(f'output_dir = 2024-01-01\n[env]\nid = "{ENV_ID}"\n')
    with pytest.raises(ValueError, match=r"date\.toml: holds a value that is not a number, string"):
        load_config(tmp_path / "date.toml")
    with pytest.raises(pydantic.ValidationError, match="steps"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", steps="3"))


TOML = """
groups_per_step = 2
steps = 2
output_dir = "{out}"
checkpoint_every = 1
progress = false

[env]
id = "{env_id}"
kwargs = {{ num_operations = 1, min_operand = 1, max_operand = 9, word_problems = false, max_turns = 3 }}

[model]
preset = "llama"
overrides = {{ hidden = 32, layers = 1 }}

[trainer]
group_size = 4
lr = 1e-3

[sampling]
max_new_tokens = 24
"""


def test_load_config_reads_yaml_and_toml_alike(tmp_path: Path) -> None:
    expected = tiny_config(tmp_path / "run")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "run")))
    (tmp_path / "train.toml").write_text(TOML.format(out=tmp_path / "run", env_id=ENV_ID))
    assert load_config(tmp_path / "train.yaml") == expected
    assert load_config(tmp_path / "train.toml") == expected
    (tmp_path / "train.json").write_text("{}")
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.toml"):
        load_config(tmp_path / "train.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("env: {id: LongStraw/Calculator-v0}\nsteps: -1\n")
    with pytest.raises(pydantic.ValidationError, match="steps"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "broken.yaml").write_text("env: {id: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "broken.toml").write_text("[env\n")
    with pytest.raises(ValueError, match=r"broken\.toml: not valid TOML"):
        load_config(tmp_path / "broken.toml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


def test_the_example_config_is_valid_and_runnable() -> None:
    """examples/train_calculator.yaml (shown in README) validates and names a registered env with valid kwargs."""
    config = load_config(REPO / "examples" / "train_calculator.yaml")
    check_env(config.env)
    assert (config.trainer.mode, config.group_size, config.trainer.loss.beta) == ("exact", 8, 0.02)


def fails_before_writing(run_dir: Path, message: str, **update) -> None:
    """``train`` raises a ConfigError matching ``message`` and leaves no run directory (no config.json, no store)."""
    with pytest.raises(ConfigError, match=message):
        train(tiny_config(run_dir, **update))
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"env": {"id": "LongStraw/Nope-v0"}}, "env.id: unknown environment"),
        ({"env": {"id": ENV_ID, "kwargs": {"max_turns": 0}}}, r"env\.kwargs\.max_turns"),
        (
            {"env": {"id": ENV_ID, "kwargs": {"max_turns": "3"}}},
            r"env\.kwargs\.max_turns: Input should be a valid integer",
        ),
        (
            {"env": {"id": ENV_ID, "kwargs": {"tokenizer": "longstraw-bpe"}}},
            r"env\.kwargs\.tokenizer: the run's environments use the top-level `tokenizer`",
        ),
        (
            {"model": {"preset": "llama", "overrides": {"hidden": 32}, "max_context": 16}},
            "context limit of 16 tokens",
        ),
        (
            {"warm_start": {"drill": [{"tokens": [10, 20]}]}},
            r"warm_start\.drill: CalculatorEnv has no drill document",
        ),
        (
            {
                "env": {"id": "LongStraw/PageRecall-v0", "kwargs": {"pages": 2, "page_tokens": 60}},
                "model": {"preset": "llama", "overrides": {"hidden": 32}, "max_context": 2048},
                "warm_start": {"drill": [{"tokens": [10, 20]}, {"tokens": [100, 2048]}]},
            },
            r"warm_start\.drill\[1\]\.tokens: a drill document of 2,048 tokens takes 2,0\d\d with its framing, "
            r"over the model's context limit of 2,048 tokens",
        ),
        (
            {"warm_start": {"env_kwargs": {"max_turns": 0}}},
            r"warm_start\.env_kwargs: invalid env\.kwargs for LongStraw/Calculator-v0:\n.*max_turns",
        ),
    ],
)
def test_configs_that_cannot_run_fail_before_the_run_directory_is_written(
    tmp_path: Path, update: dict, message: str
) -> None:
    """An unknown env, bad env kwargs or a prompt over the model's context: a ConfigError before the model is
    trained or anything is written (not at the first rollout)."""
    fails_before_writing(tmp_path / "run", message, **update)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"hiden": 128},
            r"model\.overrides\.hiden: not an argument of the llama preset; valid: vocab_size, hidden, la",
        ),
        ({"hidden": "128"}, r"model\.overrides\.hidden: Input should be a valid integer"),
        ({"hidden": 0}, r"model\.overrides\.hidden: must be at least 1"),
        ({"rope_theta": 0.5}, r"model\.overrides\.rope_theta: must be at least 1"),
        ({"hidden": 30}, r"model\.overrides: the llama preset refuses them: The hidden size \(30\) is not a multiple"),
        ({"vocab_size": 100}, r"model\.overrides\.vocab_size: the model's vocabulary has 100 tokens, fewer than the"),
    ],
)
def test_bad_preset_arguments_fail_before_writing(tmp_path: Path, overrides: dict, message: str) -> None:
    """A misspelt preset argument is a configuration error naming it, not a TypeError from the preset function."""
    fails_before_writing(tmp_path / "run", message, model={"preset": "llama", "overrides": overrides})


def test_a_preset_takes_the_rope_base_that_long_contexts_use() -> None:
    """``model.overrides.rope_theta`` sets the policy's RoPE base (Qwen3's 1e6 instead of Llama's 1e4 default)."""
    spec = ModelSpec(preset="llama", overrides={"hidden": 64, "layers": 1, "rope_theta": 1.0e6})
    rotary = build_policy(spec, check_model(spec, 512), seed=0).model.rotary_emb
    head_dim = 64 // 4
    expected = 1.0 / 1.0e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(rotary.inv_freq.double(), expected, rtol=1e-6, atol=0.0)


def unusable_model_path(tmp_path: Path, kind: str) -> Path:
    """A model directory that cannot be the policy, of ``kind``."""
    path = tmp_path / kind
    if kind == "small-vocab":
        save_tiny_llama(path, vocab_size=64)
    elif kind == "config-only":
        LlamaConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=1, num_attention_heads=4).save_pretrained(path)
    elif kind == "empty":
        path.mkdir()
    elif kind == "file":
        path.write_text("weights?")
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "model.path: no model directory at .*missing"),
        ("file", "model.path: .*file is a file, not a model directory"),
        ("empty", "model.path: .*empty has no config.json"),
        ("small-vocab", "model.path: the model's vocabulary has 64 tokens, fewer than the tokenizer's {vocab}"),
        ("config-only", "model.path: cannot load the weights in .*config-only"),
    ],
)
def test_a_model_path_that_cannot_be_the_policy_fails_before_writing(tmp_path: Path, kind: str, message: str) -> None:
    """A missing directory (not transformers' OSError "Repo id must be ...") and a model with fewer embeddings than
    the tokenizer has ids (not a failure at the first rollout) are refused before config.json or the store exist."""
    path = unusable_model_path(tmp_path, kind)
    vocab = load_tokenizer("longstraw-bpe").vocab_size
    fails_before_writing(tmp_path / "run", message.format(vocab=vocab), model={"path": str(path)})


@pytest.mark.parametrize(
    ("chat_tokens", "message"),
    [
        (None, "tokenizer: unknown tokenizer .*missing"),
        (False, r"tokenizer: '<\|im_start\|>' is not a special token of .*plain-bpe"),
    ],
    ids=["missing", "without-chat-tokens"],
)
def test_a_tokenizer_that_cannot_serve_the_envs_fails_before_writing(
    tmp_path: Path, chat_tokens: bool | None, message: str
) -> None:
    """A tokenizer without ChatML's tokens (most base models' own) cannot render the envs' prompts."""
    if chat_tokens is None:
        path = tmp_path / "missing"
    else:
        path = save_bpe_tokenizer(tmp_path / "plain-bpe", special_tokens=[ENDOFTEXT], eos_token=ENDOFTEXT)
    fails_before_writing(tmp_path / "run", message, tokenizer=str(path))


def test_report_to_takes_the_trackers_it_knows(tmp_path: Path) -> None:
    """A list of tensorboard / wandb / mlflow (a single name is a list of one, as in TRL); a typo or a repeat is an
    error naming report_to."""
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "run", report_to=["tensorboard", "wandb"])))
    assert load_config(path).report_to == ["tensorboard", "wandb"]
    assert tiny_config(tmp_path, report_to="mlflow").report_to == ["mlflow"]
    assert tiny_config(tmp_path).report_to == []
    with pytest.raises(pydantic.ValidationError, match=r"report_to\.0\n.*'tensorboard', 'wandb' or 'mlflow'"):
        tiny_config(tmp_path, report_to=["tensorbord"])
    with pytest.raises(pydantic.ValidationError, match=r"report_to\n.*names wandb more than once"):
        tiny_config(tmp_path, report_to=["wandb", "tensorboard", "wandb"])


def test_mixed_precision_needs_wider_master_weights_and_fsdp_under_cp() -> None:
    with pytest.raises(pydantic.ValidationError, match="the model's dtype is the master weights'"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", model={"dtype": "bfloat16"}, trainer={"bf16": True}))
    with pytest.raises(pydantic.ValidationError, match=r"parallel\.cp > 1 needs parallel\.fsdp"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", trainer={"bf16": True}, parallel={"cp": 2}))
    config = TrainConfig.model_validate(
        tiny_config_dict("runs/x", trainer={"bf16": True}, parallel={"cp": 2, "fsdp": True})
    )
    assert config.trainer.mixed_precision is not None and config.trainer.mixed_precision.dtype == torch.bfloat16


def test_hsdp_and_offload_need_fsdp() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"parallel\n.*offload runs through FSDP2 \(fsdp\)"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"cp": 2, "offload": True}))
    with pytest.raises(pydantic.ValidationError, match=r"hsdp shards the model .*: it needs fsdp"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"dp": 2, "cp": 2, "hsdp": True}))
    with pytest.raises(pydantic.ValidationError, match=r"hsdp .* with cp = 1 it shards nothing"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"dp": 2, "fsdp": True, "hsdp": True}))
    with pytest.raises(pydantic.ValidationError, match=r"hsdp replicates over the dp ranks: with dp = 1"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"cp": 2, "fsdp": True, "hsdp": True}))
    config = TrainConfig.model_validate(
        tiny_config_dict("runs/x", parallel={"dp": 2, "cp": 2, "fsdp": True, "hsdp": True})
    )
    assert config.parallel.hsdp


def test_two_heartbeats_fit_in_the_liveness_timeout() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"heartbeat_s \(4\) must be at most half of timeout_s \(6\)"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"timeout_s": 6.0, "heartbeat_s": 4.0}))
    spec = TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"timeout_s": 6.0, "heartbeat_s": 3.0}))
    assert spec.parallel.heartbeat_every_s == 3.0
    assert ParallelSpec(timeout_s=6.0).heartbeat_every_s == 1.5 and ParallelSpec().heartbeat_every_s == 5.0
    assert ParallelSpec().collective_timeout_s == 1800.0  # a slow rank is waited for much longer than a silent one


def test_expert_parallel_needs_fsdp_over_lockstep_cp_ranks() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"expert_parallel .* FSDP2 shards: it needs fsdp"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"cp": 2, "expert_parallel": True}))
    with pytest.raises(pydantic.ValidationError, match=r"expert_parallel .*: it needs cp > 1"):
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel={"fsdp": True, "expert_parallel": True}))
    with pytest.raises(pydantic.ValidationError, match=r"expert_parallel at dp > 1 needs hsdp"):
        flat = {"dp": 2, "cp": 2, "fsdp": True, "expert_parallel": True}
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel=flat))
    with pytest.raises(pydantic.ValidationError, match=r"sharded_extend_tokens would shard none"):
        threshold = {"cp": 2, "fsdp": True, "expert_parallel": True, "sharded_extend_tokens": 64}
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel=threshold))
    config = TrainConfig.model_validate(
        tiny_config_dict("runs/x", parallel={"dp": 2, "cp": 2, "fsdp": True, "hsdp": True, "expert_parallel": True})
    )
    assert config.parallel.expert_parallel
    assert not config.engine.sharded_extends  # (every extend replicated: the engine follows the layout)


def test_expert_dispatch_shards_long_extends_under_expert_parallelism() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"expert_dispatch .* needs expert_parallel"):
        alone = {"cp": 2, "fsdp": True, "expert_dispatch": True}
        TrainConfig.model_validate(tiny_config_dict("runs/x", parallel=alone))
    parallel = {"cp": 2, "fsdp": True, "expert_parallel": True, "expert_dispatch": True, "sharded_extend_tokens": 64}
    config = TrainConfig.model_validate(tiny_config_dict("runs/x", parallel=parallel))
    assert config.engine.sharded_extends and config.engine.sharded_extend_tokens == 64  # (read from parallel.)


@pytest.mark.parametrize(
    ("warm_start", "message"),
    [
        ({"drill": [{"tokens": [300, 100]}]}, r"tokens is \[shortest, longest\] with 1 <= shortest <= longest"),
        ({"drill": [{"tokens": [0, 100]}]}, r"1 <= shortest"),
        ({"rehearsal": 0.5}, "warm_start.rehearsal mixes in drill documents: give warm_start.drill stages"),
        ({"rehearsal": 1.0, "drill": [{"tokens": [1, 2]}]}, "rehearsal"),
        ({"drill": [{"tokens": [1, 2], "sft": {"steps": 0}}]}, "give it at least 1 step"),
    ],
)
def test_a_warm_start_drill_is_a_length_range_and_rehearsal_a_share_below_one(warm_start: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        TrainConfig.model_validate(tiny_config_dict("runs/x", warm_start=warm_start))


def test_the_warm_starts_env_kwargs_merge_over_the_runs_nested_mappings_too() -> None:
    spec = WarmStartSpec(env_kwargs={"page_tokens": 300, "context": {"strategy": {"threshold": 600}}})
    run = {"pages": 12, "context": {"max_context_tokens": 4096, "strategy": {"kind": "summary", "threshold": 2560}}}
    assert spec.episode_kwargs(run) == {
        "pages": 12,
        "page_tokens": 300,
        "context": {"max_context_tokens": 4096, "strategy": {"kind": "summary", "threshold": 600}},
    }
    assert run["context"]["strategy"]["threshold"] == 2560  # the run's own kwargs are left as they were
