"""One job, one description (longstraw_agents/job.py): the run config's ``model``, ``parallel``, ``engine`` and
``trainer`` sections are one ``JobSpec``, validated once; ``longstraw train`` builds the engine of its ``engine:``
section, ``longstraw plan --config`` and ``train --check`` plan that same job (``PlanRequest.of_job``), a plan
without a config says what it assumes, and configs and run directories written before ``engine:`` existed load.

The fixtures in tests/app/before_jobspec/ were written before this change: examples/train_calculator.yaml as it was,
and the config.json a tiny one-step run saved (``trainer.chunk_size: 64``, ``parallel.wavefront_walk: false``,
``parallel.sharded_extend_tokens: 4096``)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import yaml
from paths import REPO
from tiny_runs import tiny_config, tiny_config_dict

from longstraw_agents.app.config import TrainConfig, load_config, validation_lines
from longstraw_agents.app.run import Run
from longstraw_agents.cli import main
from longstraw_agents.engine import EngineConfig
from longstraw_agents.job import JobSpec
from longstraw_agents.models.presets import TINY_PRESETS
from longstraw_agents.plan import PLAN_ENGINE, PlanRequest, PlanShape, engine_text, parameter_phases
from longstraw_agents.plan.probes import Probe

BEFORE = Path(__file__).parent / "before_jobspec"
# every EngineConfig setting away from its default
ENGINE = {
    "chunk_size": 64,
    "attention": "eager",
    "max_score_elements": 4096,
    "exact_products": True,
    "checkpoint_every": 2,
    "grad_accumulation": "state",
    "graph_budget_bytes": 1024,
    "activation_checkpointing": True,
    "wavefront_walk": False,
    "sharded_extend_tokens": 32,
    "balanced_captures": False,
    "sharded_extends": False,
    "layer_inputs_every": 3,
}


def invalid(data: dict[str, Any]) -> str:
    """The lines ``longstraw train`` prints for a config that does not validate."""
    with pytest.raises(pydantic.ValidationError) as caught:
        TrainConfig.model_validate(data)
    return validation_lines(caught.value, schema=TrainConfig)


# -- the job spec ---------------------------------------------------------------------------------------------


def test_the_engine_section_is_every_engine_config_field_validated_by_it() -> None:
    assert set(ENGINE) == set(EngineConfig.model_fields)  # (a new field joins the test)
    config = tiny_config("runs/x", engine=ENGINE)
    assert isinstance(config, JobSpec) and config.engine == EngineConfig(**ENGINE)
    assert config.trainer.chunk_size == 64  # the trainer's chunk is the engine's
    assert tiny_config("runs/x").engine == EngineConfig()  # unset: the engine's own defaults, as the planner takes them

    said = invalid(tiny_config_dict("runs/x", engine={"attention": "fastest"}))  # EngineConfig's own rule
    assert said.startswith("  engine.attention: Value error, must be one of ['auto',")
    said = invalid(tiny_config_dict("runs/x", engine={"chunk": 64}))
    assert said == "  engine.chunk: Extra inputs are not permitted; did you mean 'chunk_size'?"
    said = invalid(tiny_config_dict("runs/x", trainer={"group_size": 4, "activation_checkpointing": True}))
    assert said == (
        "  trainer.activation_checkpointing: Extra inputs are not permitted; did you mean "
        "'engine.activation_checkpointing'?"
    )
    said = invalid(tiny_config_dict("runs/x", engine={"fsdp": True}))
    assert said == "  engine.fsdp: Extra inputs are not permitted; did you mean 'parallel.fsdp'?"


def test_settings_that_follow_another_section_are_set_once() -> None:
    """Under expert parallelism every extend is replicated unless its tokens are dispatched; a contrary setting, or
    a threshold that would shard nothing, is refused."""
    experts = {"cp": 2, "fsdp": True, "expert_parallel": True}
    assert not tiny_config("runs/x", parallel=experts).engine.sharded_extends
    assert tiny_config("runs/x", parallel=experts | {"expert_dispatch": True}).engine.sharded_extends
    said = invalid(tiny_config_dict("runs/x", parallel=experts, engine={"sharded_extends": True}))
    assert "engine.sharded_extends must be false (leave it out: it follows)" in said
    said = invalid(tiny_config_dict("runs/x", parallel=experts, engine={"sharded_extend_tokens": 64}))
    assert "engine.sharded_extend_tokens would shard none" in said


def test_a_run_builds_the_engine_of_its_config(tmp_path: Path) -> None:
    """The policy's engine and the KL reference's are ``engine:`` itself (nothing left at its default by the run)."""
    engine = {"chunk_size": 64, "activation_checkpointing": True, "max_score_elements": 4096, "attention": "eager"}
    trainer = {"group_size": 4, "beta": 0.1}
    run = Run(tiny_config(tmp_path / "run", engine=engine, trainer=trainer))
    try:
        assert run.trainer.engine.config == EngineConfig(**engine)
        assert run.trainer.ref_engine is not None and run.trainer.ref_engine.config == EngineConfig(**engine)
    finally:
        run.close()


# -- configs and run directories written before engine: -----------------------------------------------------------


def test_a_config_from_before_the_engine_section_loads_as_the_current_example() -> None:
    before = load_config(BEFORE / "train_calculator.yaml")  # trainer.chunk_size: 512
    assert before == load_config(REPO / "examples" / "train_calculator.yaml")  # engine: {chunk_size: 512}
    assert before.engine.chunk_size == before.trainer.chunk_size == 512


def test_a_saved_run_config_from_before_loads_and_is_saved_with_each_setting_once() -> None:
    """A run directory's config.json is read by --resume, export, serve and replay (``model_validate_json``)."""
    saved = (BEFORE / "config.json").read_text()
    assert '"wavefront_walk": false' in saved and '"chunk_size": 64' in saved  # (the old places)
    config = TrainConfig.model_validate_json(saved)
    assert config.engine == EngineConfig(chunk_size=64, wavefront_walk=False, sharded_extend_tokens=4096)
    assert config.trainer.chunk_size == 64
    written = json.loads(config.model_dump_json())
    assert "chunk_size" not in written["trainer"] and "wavefront_walk" not in written["parallel"]
    assert written["engine"]["chunk_size"] == 64 and not written["engine"]["wavefront_walk"]
    assert TrainConfig.model_validate(written) == config


def test_one_setting_in_its_old_and_new_place_with_two_values_is_one_line() -> None:
    data = tiny_config_dict("runs/x", trainer={"group_size": 4, "chunk_size": 64}, engine={"chunk_size": 128})
    assert invalid(data) == (
        "  (config): Value error, trainer.chunk_size (64) and engine.chunk_size (128) are one setting, "
        "engine.chunk_size (trainer.chunk_size is its place before engine:); give it once"
    )
    same = tiny_config_dict("runs/x", parallel={"balanced_captures": False}, engine={"balanced_captures": False})
    assert not TrainConfig.model_validate(same).engine.balanced_captures


def test_the_readme_run_config_snippet_validates() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```yaml\n")[1:]]
    [shown] = [block for block in blocks if block.startswith("parallel: {dp: 1, cp: 8, fsdp: true}")]
    config = tiny_config("runs/x", groups_per_step=8, **yaml.safe_load(shown))
    assert config.engine.activation_checkpointing and config.parallel.fsdp
    assert "longstraw plan --config" in readme


# -- plans of a job -----------------------------------------------------------------------------------------------


def test_plan_request_refuses_unknown_fields_in_one_line() -> None:
    mistaken: dict[str, Any] = {"chunk": 128, "offload_optimizer": True, "activation_checkpointing": False}
    with pytest.raises(TypeError) as caught:
        PlanRequest(model="tiny-llama", context=1000, gpus=1, **mistaken)
    assert str(caught.value) == (
        "PlanRequest got unknown fields 'chunk' (did you mean engine=EngineConfig(chunk_size=...)?), "
        "'offload_optimizer' (did you mean 'optimizer' or 'offload'?), 'activation_checkpointing' (did you mean "
        "engine=EngineConfig(activation_checkpointing=...)?)"
    )
    with pytest.raises(TypeError, match=r"^PlanRequest got unknown fields 'chunk' \(did you mean"):
        dataclasses.replace(PlanRequest(), chunk=128)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^PlanShape got unknown fields 'gpu' \(did you mean 'gpus'\?\)$"):
        PlanShape(gpu=4)  # type: ignore[call-arg]


def job_request(config: TrainConfig, **workload: Any) -> PlanRequest:
    model = TINY_PRESETS[config.model.preset](**config.model.overrides)  # type: ignore[index]
    return PlanRequest.of_job(config, model, **{"context": 4096, "completion": 24, "gpu_mem_bytes": 10**10} | workload)


def test_a_job_is_planned_as_the_run_runs_it() -> None:
    """The run's engine, layout (FSDP2 only where it shards), dtype and masters, mode, G and KL weight; a run config
    that says nothing plans the engine's defaults, not the published configuration's."""
    request = job_request(tiny_config("runs/x", parallel={"cp": 2}, trainer={"group_size": 4, "beta": 0.1}))
    assert (request.gpus, request.context_parallel, request.data_parallel) == (2, 2, 1)
    assert not request.sharded and request.shard_ranks == 1  # parallel.fsdp defaults to false: no FSDP2
    assert (request.engine, request.group, request.beta, request.mode) == (EngineConfig(), 4, 0.1, "exact")
    assert (request.dtype, request.mixed, request.optimizer) == (torch.float32, False, "adamw")
    mixed = job_request(tiny_config("runs/x", parallel={"cp": 2, "fsdp": True}, trainer={"bf16": True}))
    assert mixed.sharded and (mixed.dtype, mixed.master_itemsize) == (torch.bfloat16, 4)
    plain_bf16 = job_request(tiny_config("runs/x", model={"preset": "llama", "dtype": "bfloat16"}))
    assert (plain_bf16.dtype, plain_bf16.mixed) == (torch.bfloat16, False)  # AdamW steps the bf16 weights
    with pytest.raises(ValueError, match="the planner plans detached and exact modes"):
        job_request(tiny_config("runs/x", trainer={"mode": "naive"}))


def test_the_plan_of_a_run_without_fsdp_holds_the_whole_model_on_every_gpu() -> None:
    """`plan --gpus 2` (FSDP2, the published layout) against a run with `parallel: {cp: 2}` (no FSDP2), which
    measured 1.67x the former's plan: the latter's plan holds every parameter, its gradient and AdamW's state, and
    in exact mode the flat bucket in which the wavefront walk sums the gradient over cp. (Measured once, 2 gloo
    processes, tiny llama with 8 layers at dp 1 x cp 2 without FSDP2: 0.998 of the plan detached on both ranks and
    0.95 exact, against 1.70 and 1.73-1.89 of the FSDP2 plan; 2 layers over 2,048 tokens detached 1.01-1.02.)"""
    probe = Probe(graphs=0, parameters=8_000, largest_layer=700, root=1_000, layers=10)
    run = job_request(tiny_config("runs/x", parallel={"cp": 2}))  # (exact mode: the trainer's default)
    published = dataclasses.replace(run, fsdp=True)
    whole, shards = parameter_phases(probe, run), parameter_phases(probe, published)
    for phase in ("capture", "backward"):
        assert whole[phase]["weights"] == 8_000 * 4 == 2 * shards[phase]["weights"]
        assert whole[phase]["optimizer state"] == 2 * 8_000 * 4 == 2 * shards[phase]["optimizer state"]
        assert whole[phase]["gathered weights"] == 0 < shards[phase]["gathered weights"]
    assert whole["backward"]["gradients"] == whole["backward"]["gathered gradients"] == 8_000 * 4
    detached = parameter_phases(probe, dataclasses.replace(run, mode="detached"))
    assert detached["backward"]["gathered gradients"] == 0  # (every cp rank computes every branch: nothing summed)


def test_the_time_model_times_the_layout_the_job_runs() -> None:
    """Over whole weights each cp rank's AdamW steps every parameter, not its shard (``Schedule(sharded=...)``)."""
    from longstraw_agents.plan import ModelWork, step_work

    run = job_request(tiny_config("runs/x", parallel={"cp": 2}))
    model = ModelWork(run.model, torch.float32, 1e6, 0.0, 1e3, 4e6, 4e6, root_bytes=1e6)  # type: ignore[arg-type]
    whole = step_work(run, model, rollout=False).phases["optimizer"]
    shards = step_work(dataclasses.replace(run, fsdp=True), model, rollout=False).phases["optimizer"]
    assert whole.memory == 7 * 4e6 == 2 * shards.memory


def plan_table(out: str) -> str:
    """A plan's table, from its header line (the model's) to its last note."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\S+: [\d,]+ positions, G=", line))
    end = max(i for i, line in enumerate(lines) if line.startswith("note: "))
    return "\n".join(lines[start : end + 1])


def test_plan_config_and_train_check_print_the_same_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end (about 3 s): both commands on one file with cp = 2 and no FSDP2, launched as rank 0 of two."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    data = tiny_config_dict(tmp_path / "run", parallel={"cp": 2}, engine={"chunk_size": 64}, trainer={"group_size": 4})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))

    assert main(["plan", "--config", str(path)]) == 0
    planned = capsys.readouterr().out
    assert main(["train", "--check", str(path)]) == 0
    checked = capsys.readouterr().out
    assert plan_table(planned) == plan_table(checked) and planned.strip() == plan_table(planned)
    assert "G=4 x 24 tokens, exact, float32, 2 GPUs x 96 GB (dp=1, cp=2, no fsdp)" in planned
    assert "\nengine: chunk_size=64 (EngineConfig's defaults otherwise)\n" in planned
    assert "not sharded (no fsdp): every GPU holds the float32 weights" in planned
    assert "longstraw plan --config" in checked and not (tmp_path / "run").exists()

    assert main(["plan", "--config", str(path), "--chunk", "128", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {path} describes the job: --gpus (parallel.dp x parallel.cp), --chunk ")


def test_a_plan_without_a_config_says_what_it_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ("plan", "--model", "tiny-llama", "--gpus", "2", "--context", "64K", "--group", "2", "--completion", "16")
    assert main([*tiny, "--chunk", "256"]) == 0
    out = capsys.readouterr().out
    engine = PLAN_ENGINE.updated(chunk_size=256)
    assert f"\n{engine_text(engine)}\n" in out
    assert "chunk_size=256, max_score_elements=134217728, activation_checkpointing=True" in out
    [assumed] = [line for line in out.splitlines() if line.startswith("note: no --config: ")]
    assert "FSDP2 over the GPUs (--no-fsdp:" in assumed and "bfloat16 compute over fp32 masters" in assumed
    assert "--config RUN.yaml" in assumed and "(dp=1, cp=2)" in out


def test_train_help_lists_every_engine_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name, field in EngineConfig.model_fields.items():
        assert f"\n  {name} (default {field.default!r}): " in out, name
