"""Experiment trackers (``report_to``, app/reporting.py): a run's TensorBoard, wandb (offline) and MLflow (local
store) logs hold the numbers of its metrics.jsonl at the same steps and its config as hyperparameters; the trackers
finish however the run ends; a tracker whose package is missing stops the run before anything is written."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import REPO
from tiny_runs import ENV_ID, tiny_config
from tracker_logs import as_float32, expected_scalars, tensorboard_scalars

from longstraw_agents.app.check import check_config
from longstraw_agents.app.config import ConfigError, check_report_to
from longstraw_agents.app.records import MetricsRecord, StepRecord, WarmStartRecord
from longstraw_agents.app.reporting import MLflow, Reporter, WandB, hyperparameters
from longstraw_agents.app.training import train

WARM_START = {"episodes": 2, "sft": {"steps": 2, "batch_size": 1}}
README = REPO / "README.md"


def readme_tags() -> list[str]:
    """The tracker tags README's paragraph on experiment trackers names (``phase/key``)."""
    paragraph = README.read_text().split("**Experiment trackers.**", 1)[1].split("\n\n", 1)[0]
    tags = re.findall(r"`((?:warm_start|eval|grpo|replay_select)/[\w/]+)`", paragraph)
    assert tags, "README names no tracker tag"
    return tags


def reporting_run(output_dir: Path, *trackers: str, **updates: Any) -> Path:
    """A tiny 2-step run with every kind of record: warm start, evaluations before and after, GRPO steps."""
    config = tiny_config(output_dir, report_to=list(trackers), eval_episodes=2, warm_start=WARM_START, **updates)
    return train(config)


def test_tensorboard_holds_the_numbers_of_metrics_jsonl_at_their_steps(tmp_path: Path) -> None:
    run_dir = reporting_run(tmp_path / "run", "tensorboard")
    expected = expected_scalars(run_dir, {"warm_start": 0})
    assert {"warm_start/loss_last", "eval/reward_mean", "grpo/loss", "grpo/finish_reasons/max_turns"} <= set(expected)
    assert set(readme_tags()) <= set(expected)  # the tags README names are logged (a random policy runs out of turns)
    assert expected["grpo/reward_mean"][0][0] == 1 and expected["eval/reward_mean"][-1][0] == 2
    assert tensorboard_scalars(run_dir / "tensorboard") == as_float32(expected)
    # the config as hyperparameters (accelerate also keeps them as YAML beside the events)
    [saved] = (run_dir / "tensorboard").glob("*/hparams.yml")
    hparams = yaml.safe_load(saved.read_text())
    assert (
        hparams["trainer.optim.lr"] == 1e-3
        and hparams["env.id"] == ENV_ID
        and hparams["report_to"] == '["tensorboard"]'
    )


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_the_trackers_finish_when_a_run_stops_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: type[BaseException]
) -> None:
    """Ctrl-C or an error in the first GRPO step's report: the trackers are finished once, with what was logged."""
    finished: list[int] = []
    finish = Reporter.finish
    monkeypatch.setattr(Reporter, "finish", lambda self: finished.append(len(self.trackers)) or finish(self))

    def stop_at_the_first_step(record: MetricsRecord) -> None:
        if isinstance(record, StepRecord):
            raise stop

    config = tiny_config(tmp_path / "run", report_to=["tensorboard"], warm_start=WARM_START)
    with pytest.raises(stop):
        train(config, on_metrics=stop_at_the_first_step)
    assert finished == [1]  # the run closed once, finishing its one tracker
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [step for step, _ in scalars["grpo/loss"]] == [1] and "warm_start/loss_last" in scalars


def test_a_missing_tracker_package_names_the_extra_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WandB, "available", lambda self: False)
    monkeypatch.setattr(MLflow, "available", lambda self: False)
    one = r"^report_to: wandb is not installed: pip install 'longstraw-agents\[wandb\]'$"
    with pytest.raises(ConfigError, match=one):
        check_report_to(["tensorboard", "wandb"])
    both = r"report_to: wandb and mlflow are not installed: pip install 'longstraw-agents\[wandb,mlflow\]'"
    config = tiny_config(tmp_path / "run", report_to=["wandb", "mlflow"], warm_start=WARM_START)
    with pytest.raises(ConfigError, match=both):
        train(config)
    assert not (tmp_path / "run").exists()  # nothing written, no warm start or step run
    report = check_config(config)  # longstraw train --check
    assert any("longstraw-agents[wandb,mlflow]" in error for error in report.errors)


def test_the_config_is_flattened_into_hyperparameters() -> None:
    config = {"steps": 3, "trainer": {"loss": {"beta": 0.0}, "lr": 1e-3}, "warm_start": None, "env": {"kwargs": {}}}
    config |= {"report_to": ["tensorboard"], "progress": True, "output_dir": "runs/x"}
    assert hyperparameters(config) == {
        "steps": 3,
        "trainer.loss.beta": 0.0,
        "trainer.lr": 1e-3,
        "warm_start": "null",
        "env.kwargs": "{}",
        "report_to": '["tensorboard"]',
        "progress": True,
        "output_dir": "runs/x",
    }


def test_wandb_offline_gets_the_records_and_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WANDB_MODE=offline: the run is written to RUN_DIR/wandb; every log call wandb received carries the numbers
    of a metrics.jsonl line at its step."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    received: dict[str, list[tuple[int, Any]]] = {}
    log = wandb.sdk.wandb_run.Run.log

    def spy(run: Any, data: dict[str, Any], step: int | None = None, *args: Any, **kwargs: Any) -> Any:
        for tag, value in data.items():
            received.setdefault(tag, []).append((step, value))
        return log(run, data, step, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    run_dir = reporting_run(tmp_path / "run", "wandb")
    assert received == expected_scalars(run_dir, {"warm_start": 0})
    [stored] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    needles = (b"grpo/reward_mean", b"trainer.optim.lr", b"longstraw-agents")
    written = _written_by_wandb(stored, needles)
    assert all(needle in written for needle in needles), written[:200]


def _written_by_wandb(stored: Path, needles: tuple[bytes, ...], patience_s: float = 120.0) -> bytes:
    """The offline run file once it holds ``needles``: wandb's service process writes it, and on a busy machine it
    can still be flushing when ``finish`` has returned (a bounded wait for a writer, not a bound on speed)."""
    deadline = time.monotonic() + patience_s
    while True:
        written = stored.read_bytes()
        if all(needle in written for needle in needles) or time.monotonic() > deadline:
            return written
        time.sleep(0.2)


@pytest.mark.slow  # ~15 s: MLflow builds a fresh SQLite store through its alembic migrations (~8 s of it)
def test_mlflow_keeps_its_store_in_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracking URI configured: a SQLite store RUN_DIR/mlflow.db, experiment longstraw-agents, the run named
    after its directory; metric histories equal metrics.jsonl's numbers, params the flattened config. The URI is
    unset again when the run ends."""
    mlflow = pytest.importorskip("mlflow")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS"):
        monkeypatch.delenv(name, raising=False)
    assert not mlflow.is_tracking_uri_set()
    run_dir = reporting_run(tmp_path / "run", "mlflow")
    assert not mlflow.is_tracking_uri_set()

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("longstraw-agents")
    [logged] = client.search_runs([experiment.experiment_id])
    assert logged.info.run_name == "run" and logged.info.status == "FINISHED"
    assert logged.data.params["trainer.optim.lr"] == "0.001" and logged.data.params["env.id"] == ENV_ID
    expected = expected_scalars(run_dir, {"warm_start": 0})
    histories = {
        tag: [(m.step, m.value) for m in sorted(client.get_metric_history(logged.info.run_id, tag), key=_order)]
        for tag in logged.data.metrics
    }
    assert histories == {tag: [(step, float(value)) for step, value in points] for tag, points in expected.items()}


def _order(metric: Any) -> tuple[int, int]:
    return metric.step, metric.timestamp


def test_mlflow_uses_a_configured_tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_TRACKING_URI (here a file store under tmp_path) is where the run goes; nothing in the run directory."""
    mlflow = pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for such uses only
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "elsewhere")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reporter = Reporter.start(["mlflow"], run_dir, {"trainer": {"lr": 0.001}})
    reporter.log(WarmStartRecord(episodes=2, steps=1, loss_first=2.5, loss_last=2.0, seconds=0.5), step=0)
    reporter.finish()
    assert list(run_dir.iterdir()) == []
    client = mlflow.MlflowClient(tracking_uri=store.as_uri())
    [logged] = client.search_runs([client.get_experiment_by_name("elsewhere").experiment_id])
    assert logged.data.params == {"trainer.lr": "0.001"}
    numbers = {"episodes": 2, "drills": 0, "steps": 1, "loss_first": 2.5, "loss_last": 2.0, "seconds": 0.5}
    assert logged.data.metrics == {f"warm_start/{key}": value for key, value in numbers.items()}
