"""What a memory plan describes — the step's sizes and how the GPUs split — checked without torch.

``PlanShape`` holds the fields of ``request.PlanRequest`` that need no model and no engine, with their checks (counts
and sizes positive, the GPUs splitting into ``dp x cp``, a layout the run config's ``parallel:`` section would take:
``layout.layout_problem``, the same rules); ``PlanRequest`` extends it with the dtype and the engine.
``longstraw plan`` checks its arguments here before it imports torch and transformers (seconds of CPU), so that a bad
flag fails at once. An unknown keyword is a ``TypeError`` of one line naming the closest field.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import ArgsKwargs

from longstraw_agents.layout import layout_problem

Positive = Annotated[int, Field(ge=1)]


# The models ``longstraw plan`` knows by name: ``configs.NAMED_MODELS`` as shipped (whose configs need transformers; a
# test keeps the two equal; tests and benchmarks add models of their own to NAMED_MODELS)
MODEL_NAMES = ("qwen3.6-27b", "glm-5.2", "tiny-llama", "tiny-qwen3", "tiny-qwen3_5", "tiny-glm_moe_dsa")


def model_file_problem(model: str) -> str | None:
    """What is wrong with ``model`` given as a transformers config (a ``config.json``, or a folder holding one): that
    it does not exist. None when it does, or when ``model`` is no path (a name)."""
    path = Path(model)
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{model} holds no config.json"
    looks_like_a_path = path.suffix == ".json" or os.sep in model or (os.altsep is not None and os.altsep in model)
    return f"{model} does not exist" if looks_like_a_path and not path.is_file() else None


def model_problem(model: str, names: Iterable[str] = MODEL_NAMES) -> str | None:
    """What is wrong with ``model``, one of ``names`` or a transformers config: a file that does not exist, or a name
    that is not known. None when nothing is."""
    if model in names:
        return None
    file_problem = model_file_problem(model)
    if file_problem is not None or Path(model).exists():
        return file_problem
    return f"unknown model {model!r}: give one of {sorted(names)} or a config.json path"


@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class PlanShape:
    """A plan's sizes and layout. ``context`` counts the shared prompt's positions; ``completion`` each member's own
    tokens — or, for agents whose members grow long after they part (``history``), the tokens of one answer.

    Validated on construction (and by ``dataclasses.replace``): counts and sizes are positive, ``beta`` finite and
    not negative, a model file exists, and the GPUs split into ``dp x cp``; a bad value raises pydantic's
    ``ValidationError``."""

    model: str = "qwen3.6-27b"  # a name of configs.NAMED_MODELS or a transformers config.json (or its folder)
    context: Positive = 2_100_000
    group: Positive = 8
    completion: Positive = 1024
    # an agent's own history after the shared context (tool outputs and answers, the longest member's), over
    # ``turns`` turns; 0: a completion only (the published shape). The step walks one member's path at a time,
    # spread over the cp ranks like the context; the in-process sampler holds every member's
    history: Annotated[int, Field(ge=0)] = 0
    turns: Positive = 1
    gpus: Positive = 8
    gpu_mem_bytes: Positive = 96 * 10**9
    cp: Positive | None = None  # context-parallel ranks (default: gpus / dp)
    dp: Positive | None = None  # data-parallel ranks (default: gpus / cp, or 1 when cp is not given either)
    # FSDP2 over the GPUs (parallel.fsdp; on by default: the published layout). False: every GPU holds the whole
    # model, its gradients and AdamW's state, as a run without parallel.fsdp does
    fsdp: bool = True
    mode: Literal["detached", "exact"] = "detached"
    optimizer: Literal["adamw", "none"] = "adamw"
    # FSDP2's CPU offload (parallel.offload): master shards, their gradients and AdamW's state on the host
    offload: bool = False
    hsdp: bool = False  # FSDP2 over each dp rank's cp ranks, replicated over dp (parallel.hsdp)
    # each cp rank holds whole experts, never gathered (parallel.experts): every extend replicated (the run's
    # default), or with ``expert_dispatch`` long ones sharded, their tokens dispatched to their experts' ranks
    # (parallel.expert_dispatch); exact mode walks replicated either way
    expert_parallel: bool = False
    expert_dispatch: bool = False
    beta: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    # the cp rank planned (None: per term the rank holding the most — rank 0 of a balanced capture, the last in rank
    # order: an upper bound of the per-GPU peak)
    cp_rank: Annotated[int, Field(ge=0)] | None = None
    # the groups one dp rank trains in an optimizer step (TrainConfig.groups_per_step / dp): the capture of a later
    # group holds the gradients the earlier ones left (the step starts with none)
    groups_per_rank: Positive = 1

    @property
    def context_parallel(self) -> int:
        if self.cp is not None:
            return self.cp
        return self.gpus // self.dp if self.dp is not None else self.gpus

    @property
    def data_parallel(self) -> int:
        if self.dp is not None:
            return self.dp
        return self.gpus // self.cp if self.cp is not None else 1

    @property
    def own_tokens(self) -> int:
        """Each member's tokens after the shared context: its history, or its completion."""
        return self.history or self.completion

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the model (``fsdp`` over 2 or more GPUs; on one it leaves the model whole)."""
        return self.fsdp and self.gpus > 1

    @property
    def shard_ranks(self) -> int:
        """The GPUs one parameter is sharded over: all of them, with ``hsdp`` one dp rank's cp ranks, unsharded 1."""
        if not self.sharded:
            return 1
        return self.context_parallel if self.hsdp else self.gpus

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        """An unknown keyword is a TypeError of one line (as a function's), naming the closest field of each."""
        given = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(given, dict):
            return data
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [name for name in given if name not in names]
        if unknown:
            meant = {name: repr(name) for name in names} | cls._elsewhere()
            said = ", ".join(f"{name!r}{_did_you_mean(name, meant)}" for name in unknown)
            raise TypeError(f"{cls.__name__} got unknown fields {said}")
        return data

    @classmethod
    def _elsewhere(cls) -> dict[str, str]:
        """Settings that are not fields but which an unknown keyword may mean, with how to give them (none here:
        ``PlanRequest`` names its engine's)."""
        return {}

    @field_validator("model")
    @classmethod
    def _model_file_exists(cls, model: str) -> str:
        problem = model_file_problem(model) if isinstance(model, str) else None  # (PlanRequest takes a config too)
        if problem is not None:
            raise ValueError(problem)
        return model

    @model_validator(mode="after")
    def _gpus_split_into_dp_and_cp(self) -> PlanShape:
        # Each message names only the settings given: a derived dp or cp is no value the caller chose.
        if self.dp is not None and self.cp is not None and self.dp * self.cp != self.gpus:
            raise ValueError(f"dp ({self.dp}) x cp ({self.cp}) must equal gpus ({self.gpus})")
        for name, ranks in (("dp", self.dp), ("cp", self.cp)):
            if ranks is not None and self.gpus % ranks:
                raise ValueError(f"gpus ({self.gpus}) is not a multiple of {name} ({ranks})")
        if self.cp_rank is not None and self.cp_rank >= self.context_parallel:
            raise ValueError(f"cp_rank ({self.cp_rank}) must be below cp ({self.context_parallel})")
        layout = layout_problem(
            self.data_parallel,
            self.context_parallel,
            self.fsdp,
            self.hsdp,
            self.offload,
            self.expert_parallel,
            self.expert_dispatch,
        )
        if layout is not None:
            raise ValueError(layout)
        if self.turns > 1 and not self.history:
            raise ValueError(f"turns ({self.turns}) describe a history: give history as well")
        if self.history and self.history < self.turns * (self.completion + 1):
            raise ValueError(
                f"a history of {self.history} tokens cannot hold {self.turns} turns of a tool output and a "
                f"{self.completion}-token answer (completion) each"
            )
        return self


def _did_you_mean(name: str, meant: dict[str, str]) -> str:
    """`` (did you mean X?)`` for the setting of ``meant`` closest to ``name`` (and a second nearly as close: ``X or
    Y``), each given as its value says; nothing when none is close."""
    scored = sorted(((difflib.SequenceMatcher(None, name, other).ratio(), other) for other in meant), reverse=True)
    close = [other for score, other in scored[:2] if score >= max(0.5, scored[0][0] - 0.15)]
    return f" (did you mean {' or '.join(meant[other] for other in close)}?)" if close else ""
