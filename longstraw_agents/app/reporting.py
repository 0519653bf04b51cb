"""Experiment trackers (``report_to``): TensorBoard, Weights & Biases and MLflow through accelerate's trackers
(``accelerate.tracking``), fed the records that go to ``metrics.jsonl`` (which stays the run's own record).

Each record is one ``log`` call of its numbers, named by its phase (``grpo/reward_mean``, ``eval/reward_mean``,
``warm_start/loss_last``, ``replay_select/groups_trained``; a mapping's numbers under its key:
``grpo/finish_reasons/stop``), at the optimizer step it belongs to (0 for the warm start and the evaluation before
GRPO); text and lists stay in ``metrics.jsonl``. The run's config is logged as hyperparameters, flattened
(``trainer.optim.lr``). Only the writer process (global rank 0) reports.

Where each tracker writes, unless its own settings say otherwise:

- ``tensorboard``: ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``);
- ``wandb``: ``RUN_DIR/wandb`` (``WANDB_DIR`` elsewhere), project ``longstraw-agents`` (``WANDB_PROJECT``), the run
  named after the run directory; ``WANDB_MODE=offline`` keeps it on the machine (``wandb sync`` uploads it later);
- ``mlflow``: a SQLite store ``RUN_DIR/mlflow.db`` with its artifacts in ``RUN_DIR/mlflow-artifacts``
  (``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``), unless ``MLFLOW_TRACKING_URI`` (or
  ``mlflow.set_tracking_uri``) names a server or store; experiment ``longstraw-agents`` (``MLFLOW_EXPERIMENT_NAME``).
"""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from accelerate import PartialState
from accelerate.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker
from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

from longstraw_agents.app.records import MetricsRecord

log = logging.getLogger(__name__)

TrackerName = Literal["tensorboard", "wandb", "mlflow"]
PROJECT = "longstraw-agents"
"""The wandb project and MLflow experiment a run reports to, unless ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME``
name another."""

Hyperparameter = bool | int | float | str


class TrackerKind(ABC):
    """One tracker ``report_to`` can name (the package extra of the same name installs it): whether it is
    installed, and accelerate's tracker for a run directory."""

    name: ClassVar[TrackerName]

    @abstractmethod
    def available(self) -> bool:
        """Whether the package accelerate's tracker imports is installed."""

    @abstractmethod
    def build(self, run_dir: Path) -> GeneralTracker:
        """accelerate's tracker for the run in ``run_dir`` (not started)."""


class TensorBoard(TrackerKind):
    name = "tensorboard"

    def available(self) -> bool:
        return is_tensorboard_available()

    def build(self, run_dir: Path) -> GeneralTracker:
        # accelerate's SummaryWriter writes to logging_dir/run_name
        return TensorBoardTracker(run_name="tensorboard", logging_dir=run_dir)


class WandB(TrackerKind):
    name = "wandb"

    def available(self) -> bool:
        return is_wandb_available()

    def build(self, run_dir: Path) -> GeneralTracker:
        # wandb.init's arguments outrank its environment variables (accelerate passes run_name as the project)
        directory = os.environ.get("WANDB_DIR", str(run_dir))
        return WandBTracker(os.environ.get("WANDB_PROJECT", PROJECT), dir=directory, name=run_dir.name)


class MLflow(TrackerKind):
    name = "mlflow"

    def available(self) -> bool:
        return is_mlflow_available()

    def build(self, run_dir: Path) -> GeneralTracker:
        return RunDirMLflowTracker(run_dir, experiment_name=PROJECT, run_name=run_dir.name)


class RunDirMLflowTracker(MLflowTracker):
    """accelerate's MLflow tracker, storing in the run directory (``RUN_DIR/mlflow.db``) when no tracking URI is
    configured (MLflow's own default would be ``mlflow.db`` in the working directory). The URI is mlflow's global
    state: it is set for the run and unset when the run finishes, so that a later run in the process gets its own."""

    def __init__(self, run_dir: Path, **kwargs: Any):
        import mlflow

        self.store_uri = None if mlflow.is_tracking_uri_set() else f"sqlite:///{(run_dir / 'mlflow.db').absolute()}"
        if self.store_uri is not None:  # the experiment's artifacts beside its store, not in the working directory
            kwargs["logging_dir"] = (run_dir / "mlflow-artifacts").absolute().as_uri()
        super().__init__(**kwargs)

    def start(self) -> None:
        import mlflow

        if self.store_uri is not None:
            mlflow.set_tracking_uri(self.store_uri)
        super().start()

    def finish(self) -> None:
        import mlflow

        try:
            super().finish()
        finally:
            if self.store_uri is not None:
                unset: Any = None  # set_tracking_uri(None) unsets it (its annotation leaves None out)
                mlflow.set_tracking_uri(unset)


TRACKERS: dict[str, TrackerKind] = {kind.name: kind for kind in (TensorBoard(), WandB(), MLflow())}


def missing_trackers(names: Sequence[str]) -> list[str]:
    """The trackers of ``names`` whose package is not installed."""
    return [name for name in names if not TRACKERS[name].available()]


def install_command(names: Sequence[str]) -> str:
    """What installs the packages of the trackers ``names`` (the package's extras of the same names)."""
    return f"pip install 'longstraw-agents[{','.join(names)}]'"


class Reporter:
    """A run's started trackers: each gets every metrics record, and is finished once (``finish``)."""

    def __init__(self, trackers: Sequence[GeneralTracker]):
        self.trackers = list(trackers)

    @classmethod
    def start(cls, names: Sequence[str], run_dir: Path, config: Mapping[str, Any]) -> Reporter:
        """Start the trackers of ``names`` for the run in ``run_dir`` and log ``config`` (the run's config as JSON
        data) as their hyperparameters; a tracker that fails to start finishes those already started."""
        # accelerate's trackers log through accelerate's logger, which needs its process state: made here (the warm
        # start reports before the trainer's Accelerator exists) as that Accelerator makes it. Without cpu=True on a
        # CPU-only node this rank would take itself for a lone process under torchrun, unlike its peers, and their
        # checkpoint's collectives would hang.
        PartialState(cpu=not torch.cuda.is_available())
        reporter = cls([])
        try:
            for name in names:
                tracker = TRACKERS[name].build(run_dir)
                tracker.start()
                reporter.trackers.append(tracker)
                tracker.store_init_configuration(hyperparameters(config))
        except BaseException:
            reporter.finish()
            raise
        return reporter

    def log(self, record: MetricsRecord, step: int) -> None:
        values = record.tracker_values()
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def finish(self) -> None:
        """Finish every tracker; one that fails is reported and the others still finish (the run itself is done
        and saved by then). A second call does nothing."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.finish()
            except Exception as err:
                log.warning("report_to: %s did not finish cleanly: %s", tracker.name, err)


def hyperparameters(config: Mapping[str, Any]) -> dict[str, Hyperparameter]:
    """``config`` (JSON data) flattened for a tracker's hyperparameters: nested keys joined by dots
    (``trainer.loss.beta``); a value that is not a number, string or bool (a list, null) as its JSON text."""
    return dict(_flattened(config, ""))


def _flattened(data: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Hyperparameter]]:
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flattened(value, f"{name}.")
        elif isinstance(value, bool | int | float | str):
            yield name, value
        else:
            yield name, json.dumps(value)
