"""Planning a GRPO step before renting the GPUs: its peak memory per GPU (``plan_memory``: ``longstraw plan``) and
its time by phase (``step_time``: ``longstraw plan --time``).

    plan = plan_memory(PlanRequest(model="qwen3.6-27b", context=2_100_000, group=8, gpus=8))
    print(plan.table(), step_time(plan.request, PROFILES["h200"]).table(), sep="\\n")

The memory plan: ``shape`` (a plan's sizes and layout, checked without torch), ``request`` (``PlanRequest``: the
dtype and engine too), ``configs`` (the models, cut to a few layers, on the meta device), ``probes`` (simulated
steps, with ``meta_cache``), ``growing`` (what grows with the context), ``parameters`` (what the parameters take per
phase), ``memory_plan`` (``Plan`` and its table), ``planner`` (the plan put together). The time model: ``work``,
``phases``, ``hardware``, ``timing``.

Importing this package imports no torch: ``longstraw plan`` checks its arguments (``PlanShape``) before it imports
torch and transformers (seconds of CPU). Every other name below is imported from its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from longstraw_agents.plan.shape import MODEL_NAMES, PlanShape, model_problem

if TYPE_CHECKING:  # (for type checkers; at run time each name is imported on first use: ``__getattr__``)
    from longstraw_agents.plan.configs import (
        NAMED_MODELS,
        is_mixture_of_experts,
        layer_period,
        load_config,
        meta_model,
        with_layers,
    )
    from longstraw_agents.plan.growing import capture_rows_bytes, exact_terms, layer_inputs_bytes
    from longstraw_agents.plan.hardware import (
        H200_PRIOR,
        PROFILES,
        Efficiency,
        HardwareProfile,
        calibrate,
        measured_profile,
    )
    from longstraw_agents.plan.memory_plan import GIB, Plan, engine_text
    from longstraw_agents.plan.parameters import host_terms, parameter_phases
    from longstraw_agents.plan.phases import Schedule, StepWork, step_work
    from longstraw_agents.plan.planner import (
        CONTEXT_SEARCH_LIMIT,
        expert_parallel_alternative,
        longest_context,
        plan_memory,
        rollout_terms,
    )
    from longstraw_agents.plan.probes import extrapolated, probe
    from longstraw_agents.plan.request import PLAN_ENGINE, PlanRequest
    from longstraw_agents.plan.timing import StepTime, step_time
    from longstraw_agents.plan.work import ModelWork, Work, total

# Names imported on first use (PEP 562), by the module that defines them: each of those imports torch.
_HOMES = {
    "configs": ("NAMED_MODELS", "is_mixture_of_experts", "layer_period", "load_config", "meta_model", "with_layers"),
    "growing": ("capture_rows_bytes", "exact_terms", "layer_inputs_bytes"),
    "hardware": ("H200_PRIOR", "PROFILES", "Efficiency", "HardwareProfile", "calibrate", "measured_profile"),
    "memory_plan": ("GIB", "Plan", "engine_text"),
    "parameters": ("host_terms", "parameter_phases"),
    "planner": (
        "CONTEXT_SEARCH_LIMIT",
        "expert_parallel_alternative",
        "longest_context",
        "plan_memory",
        "rollout_terms",
    ),
    "probes": ("extrapolated", "probe"),
    "request": ("PLAN_ENGINE", "PlanRequest"),
    "phases": ("Schedule", "StepWork", "step_work"),
    "timing": ("StepTime", "step_time"),
    "work": ("ModelWork", "Work", "total"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "CONTEXT_SEARCH_LIMIT",
    "GIB",
    "H200_PRIOR",
    "MODEL_NAMES",
    "NAMED_MODELS",
    "PLAN_ENGINE",
    "PROFILES",
    "Efficiency",
    "HardwareProfile",
    "ModelWork",
    "Plan",
    "PlanRequest",
    "PlanShape",
    "Schedule",
    "StepTime",
    "StepWork",
    "Work",
    "calibrate",
    "capture_rows_bytes",
    "engine_text",
    "exact_terms",
    "expert_parallel_alternative",
    "extrapolated",
    "host_terms",
    "is_mixture_of_experts",
    "layer_inputs_bytes",
    "layer_period",
    "load_config",
    "longest_context",
    "measured_profile",
    "meta_model",
    "model_problem",
    "parameter_phases",
    "plan_memory",
    "probe",
    "rollout_terms",
    "step_time",
    "step_work",
    "total",
    "with_layers",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # (the next lookup finds it at once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
