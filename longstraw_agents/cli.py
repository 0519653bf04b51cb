"""The ``longstraw`` command line. Each subcommand lives in a small function; heavy imports happen inside it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from longstraw_agents import __version__

if TYPE_CHECKING:
    from longstraw_agents.plan import HardwareProfile, PlanRequest


def _cmd_envs(args: argparse.Namespace) -> int:
    from longstraw_agents.envs import registered_env_ids

    for env_id in registered_env_ids():
        print(env_id)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from longstraw_agents.report import summary_text
    from longstraw_agents.store import Store, StoreError

    try:
        with Store.open(args.db, create=False) as store:
            report = summary_text(
                store,
                episode=args.episode,
                group=args.group,
                transcript=args.transcript,
                where=args.where,
                max_text=args.max_text,
            )
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _validation_message(err, schema=None) -> str:
    from longstraw_agents.app.config import validation_lines

    return "invalid configuration:\n" + validation_lines(err, schema=schema)


def _print_record(record) -> None:
    print(record.summary(), flush=True)


def _cmd_train(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from longstraw_agents.app.config import ConfigError, TrainConfig, load_config
    from longstraw_agents.app.training import train
    from longstraw_agents.parallel.launch import Place, RankFailure
    from longstraw_agents.rollout import ContextLimitError
    from longstraw_agents.sampler import SamplerError
    from longstraw_agents.store import StoreError
    from longstraw_agents.weight_sync import WeightSyncError

    try:
        config = load_config(args.config)
        overrides = (("output_dir", args.output_dir), ("steps", args.steps), ("seed", args.seed))
        updates = {k: v for k, v in overrides if v is not None}
        if updates:
            config = TrainConfig.model_validate({**config.model_dump(), **updates})
    except ValidationError as err:
        return _fail(_validation_message(err, TrainConfig))
    except (FileNotFoundError, ValueError) as err:  # incl. YAML/TOML syntax errors, which name the file
        return _fail(str(err))
    if args.check:
        return _check(config, args)
    try:
        run_dir = train(config, resume=args.resume, on_metrics=_print_record)
    except (ConfigError, ContextLimitError, FileExistsError, FileNotFoundError, StoreError) as err:
        return _fail(str(err))  # a damaged store: the line `longstraw inspect` prints for it
    except (SamplerError, WeightSyncError) as err:  # a served policy's server failed, or refused the weights
        return _fail(f"{err}\nfix the server and run again (--resume continues from the last checkpoint, if any)")
    except RankFailure as err:  # another process of the job died, hung or never joined: it says which
        return _fail(str(err))
    except KeyboardInterrupt:
        print(_interrupted(Path(config.output_dir)), file=sys.stderr)
        return 130
    if Place.here().rank == 0:  # the writer: under a launcher the other processes have nothing to add
        print(f"run directory: {run_dir}")
    return 0


def _interrupted(run_dir: Path) -> str:
    """What Ctrl-C left and what to do next: resume from the checkpoint, or, stopped before the first one (in the
    warm start), start again; the run directory then holds no run (no checkpoint, no run row in the store)."""
    from longstraw_agents.app.run import has_checkpoint

    if has_checkpoint(run_dir):
        return "interrupted; the checkpoint and the store are consistent (resume with --resume)"
    return (
        "interrupted before the run's first checkpoint: there is nothing to resume; run the same command again "
        "(without --resume) to start the run over"
    )


def _check(config, args: argparse.Namespace) -> int:
    """``train --check``: what would run (stdout) or every problem found (stderr), without loading weights."""
    from longstraw_agents.app.check import check_config
    from longstraw_agents.parallel.launch import Place

    report = check_config(config, resume=args.resume)
    if not report.ok:  # (every process of a launch: each checks its own node)
        return _fail(f"{args.config} would not run:\n" + "\n".join(f"  {line}" for line in report.errors))
    if Place.here().rank == 0:
        print(f"{args.config}: OK, nothing was written. `longstraw train` would run:\n{report.summary()}")
        if args.plan:
            print(_check_plan(config, args.config), flush=True)
    return 0


def _check_plan(config, path: str) -> str:
    """``train --check``'s memory plan of the run's step: the table ``longstraw plan --config`` prints for the same
    file, or why there is none (a job the planner does not plan: naive mode...)."""
    from pydantic import ValidationError

    from longstraw_agents.app.config import ConfigError
    from longstraw_agents.app.planning import run_plan_request
    from longstraw_agents.plan import plan_memory

    header = f"its step's peak memory per GPU (`longstraw plan --config {path}`, which takes --context and --gpu-mem):"
    try:
        return f"{header}\n{plan_memory(run_plan_request(config)).table()}"
    except ValidationError as err:
        return f"{header} not planned:\n" + _plan_errors(err).removeprefix("invalid plan:\n")
    except (ConfigError, ValueError) as err:
        return f"{header} not planned: {err}"


def _cmd_replay(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from longstraw_agents.app.replay import ReplayConfig, ReplayMismatch, replay
    from longstraw_agents.store import StoreError

    try:
        config = ReplayConfig(
            where=args.where,
            steps=args.steps,
            groups_per_step=args.groups_per_step,
            max_staleness=args.max_staleness,
            keep_stale=args.keep_stale,
            tis_cap=args.tis_cap,
            fork_at=args.fork_at,
            fork_group_size=args.fork_group_size,
            recorded_tools=args.recorded_tools,
        )
        out = replay(args.db, config, run_dir=args.run, out_dir=args.out, on_metrics=_print_record)
    except ValidationError as err:
        return _fail(_validation_message(err))
    except (StoreError, FileNotFoundError, FileExistsError, ReplayMismatch, ValueError) as err:
        return _fail(str(err))
    print(f"replay run directory: {out}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from longstraw_agents.app.plotting import plot_run

    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    if not written:
        return _fail(f"{args.run_dir}/metrics.jsonl has no GRPO steps to plot")
    for path in written:
        print(path)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from longstraw_agents.app.config import ConfigError
    from longstraw_agents.app.export import export_hf

    try:
        out = export_hf(args.run_dir, args.out, force=args.force, merged=args.merged)
    except (ConfigError, FileNotFoundError, FileExistsError) as err:
        return _fail(str(err))
    adapter = (out / "adapter_config.json").is_file()
    print(f"{'PEFT adapter' if adapter else 'Hugging Face model'} directory: {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Load the policy, then serve until Ctrl-C (exit 130, as an interrupted ``train``; also while loading)."""
    try:
        return _serve(args)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 130


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from longstraw_agents.app.config import ConfigError
    from longstraw_agents.app.serve import load_policy, policy_server, quiet_transformers
    from longstraw_agents.serving import ServingLimits

    given = {"max_tokens": args.max_tokens, "memory_budget": args.memory_budget, "queue_timeout_s": args.queue_timeout}
    try:
        limits = ServingLimits(**{name: value for name, value in given.items() if value is not None})
    except ValidationError as err:  # a bound the flags' own checks do not cover, e.g. --queue-timeout 1e9
        first = err.errors()[0]
        return _fail(f"serve: {first['loc'][0]}: {first['msg']}")
    try:
        policy = load_policy(args.path, dtype=args.dtype, device=args.device)
    except (ConfigError, FileNotFoundError) as err:
        return _fail(str(err))
    try:
        server = policy_server(
            policy,
            host=args.host,
            port=args.port,
            model_name=args.model_name or args.path,
            model_path=args.path,
            weight_version=args.weight_version,
            limits=limits,
        )
    except OSError as err:  # the address is taken, or not this machine's
        return _fail(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}")
    _announce(server, args.path, policy.source)
    with quiet_transformers():  # e.g. a tokenizer's warning about a long prompt: the server answers for it
        server.serve_forever()
    return 0


def _announce(server, path: str, source: str) -> None:
    """The banner: where the server listens, then its limits."""
    print(
        f"serving {path} ({source}) as {server.model_name!r} on {server.url}/v1 "
        "(chat/completions, completions, models); Ctrl-C stops",
        flush=True,
    )
    context = f"{server.context:,}" if server.context is not None else "unbounded"
    print(
        f"limits: max_tokens {server.limits.max_tokens:,} (--max-tokens), context {context}, memory budget "
        f"{server.budget.total_bytes / 2**30:.2f} GiB over the requests in flight (--memory-budget; a request waits "
        f"up to {server.limits.queue_timeout_s:g} s for room, --queue-timeout)",
        flush=True,
    )


def _cmd_view(args: argparse.Namespace) -> int:
    """Write the self-contained page, or serve the viewer until Ctrl-C (exit 130, as ``serve``)."""
    from longstraw_agents.store import StoreError
    from longstraw_agents.viewer import ViewSource

    where, params = (args.where, []) if args.group is None else ("group_id = ?", [args.group])
    try:
        source = ViewSource(args.path, where, params, tokenizer=args.tokenizer)
    except StoreError as err:
        return _fail(str(err))
    if not source.summaries:
        if args.group is not None:
            return _fail(f"no group {args.group!r} in {source.db}")
        return _fail(f"no episode of {source.db} matches --where {where!r}" if where else f"{source.db} is empty")
    if args.serve:
        try:
            return _serve_view(source, args.port)
        except KeyboardInterrupt:
            print("stopped", file=sys.stderr)
            return 130
    from longstraw_agents.viewer import MAX_GROUPS, write_page

    max_groups = MAX_GROUPS if args.max_groups is None else args.max_groups
    try:
        page = write_page(source, args.out or source.db.parent / "view.html", max_groups=max_groups)
    except (ValueError, OSError) as err:
        return _fail(str(err))
    print(
        f"wrote {page.path} ({page.bytes / 1e6:.2f} MB, {page.groups} of {page.selected} selected groups); "
        "open it in a browser (it needs no network)"
    )
    return 0


def _serve_view(source, port: int) -> int:
    from longstraw_agents.viewer import ViewerServer

    try:
        server = ViewerServer(source, port=port)
    except OSError as err:  # the port is taken
        return _fail(f"cannot listen on port {port}: {err.strerror or err}")
    print(f"viewing {source.db} ({len(source.summaries):,} groups) on {server.url}; Ctrl-C stops", flush=True)
    server.serve_forever()
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (0-65535; 0 picks a free one)")
    return port


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"not a positive number: {text!r}")
    return value


def _positive_quantity(text: str) -> int:
    value = _quantity(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (e.g. 8G, 512M)")
    return value


def _quantity(text: str) -> int:
    """``2.1M`` / ``96GB`` / ``512K`` / ``4096`` as an integer (K, M, G: powers of 1000, as GPU sizes are sold)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    value = text.strip().upper().removesuffix("B")
    scale = units.get(value[-1:], 1)
    try:
        number = float(value[:-1] if value[-1:] in units else value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2.1M, 96GB, 4096)") from None
    return int(number * scale)


# PlanRequest and EngineConfig fields whose flag is not the field's name with dashes
_PLAN_FLAGS = {
    "gpu_mem_bytes": "--gpu-mem",
    "graph_budget_bytes": "--graph-budget",
    "mixed_precision": "--no-mixed-precision",
    "chunk_size": "--chunk",
    "wavefront_walk": "--walk",
    "balanced_captures": "--capture",
}


def _plan_errors(err) -> str:
    """A plan's ValidationError as one line per problem, each naming its flag."""
    lines = []
    for e in err.errors():
        said = e.get("ctx", {}).get("error", e["msg"]) if e["type"] == "value_error" else e["msg"]
        if not e["loc"]:  # the request as a whole (how the GPUs split): the check's own words
            lines.append(f"  {said}")
            continue
        name = str(e["loc"][0])
        lines.append(f"  {_PLAN_FLAGS.get(name, '--' + name.replace('_', '-'))}: {said}")
    return "invalid plan:\n" + "\n".join(lines)


# `longstraw plan`'s flags that describe the job (not its workload or GPUs): where a run config (`--config`) says
# each, and what a plan without one assumes — the published configuration (the engine's flags: PLAN_ENGINE's)
_JOB_FLAGS: dict[str, tuple[str, Any]] = {
    "model": ("model", "qwen3.6-27b"),
    "group": ("trainer.group_size", 8),
    "groups_per_rank": ("groups_per_step / parallel.dp", 1),
    "completion": ("sampling.max_new_tokens", 1024),
    "gpus": ("parallel.dp x parallel.cp", 8),
    "dp": ("parallel.dp", None),
    "cp": ("parallel.cp", None),
    "fsdp": ("parallel.fsdp", True),
    "hsdp": ("parallel.hsdp", False),
    "offload": ("parallel.offload", False),
    "expert_parallel": ("parallel.expert_parallel", False),
    "expert_dispatch": ("parallel.expert_dispatch", False),
    "mode": ("trainer.mode", "detached"),
    "dtype": ("model.dtype and trainer.mixed_precision", "bfloat16"),
    "no_mixed_precision": ("trainer.mixed_precision", False),
    "optimizer": ("the trainer's AdamW", "adamw"),
    "beta": ("trainer.beta", 0.0),
    "chunk": ("engine.chunk_size", None),
    "checkpoint_every": ("engine.checkpoint_every", None),
    "graph_budget": ("engine.graph_budget_bytes", None),
    "activation_checkpointing": ("engine.activation_checkpointing", None),
    "walk": ("engine.wavefront_walk", None),
    "capture": ("engine.balanced_captures", None),
}


def _given_job_flags(args: argparse.Namespace) -> list[str]:
    """The job's flags given on the command line (each defaults to None: given, it is set)."""
    return [name for name in _JOB_FLAGS if getattr(args, name) is not None]


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.longest and args.context is not None:
        return _fail("--longest searches the context length itself: give --context or --longest, not both")
    if args.config is None:
        return _plan_flags(args)
    given = _given_job_flags(args)
    if given:
        said = ", ".join(f"{_flag(name)} ({_JOB_FLAGS[name][0]})" for name in given)
        return _fail(
            f"--config {args.config} describes the job: {said} {'is' if len(given) == 1 else 'are'} set there; with "
            "--config, plan takes --context, --history, --turns, --gpu-mem, --cp-rank, --longest and --time"
        )
    return _plan_config(args)


def _plan_flags(args: argparse.Namespace) -> int:
    """``longstraw plan`` without a run config: the job of the flags, the published configuration where they are
    silent (said in a note of the plan)."""
    from pydantic import ValidationError

    from longstraw_agents.plan import PlanShape, model_problem

    job = _flags_job(args)
    problem = model_problem(job["model"])
    if problem is not None:
        return _fail(f"invalid plan:\n  --model: {problem}")
    try:  # the arguments first, without torch: importing it and transformers takes seconds of CPU
        PlanShape(**_flags_shape(args, job))
    except ValidationError as err:
        return _fail(_plan_errors(err))
    return _run_plan(args, lambda: _flags_request(args, job), assumed=_assumed(args, job))


def flags_plan_request(argv: Sequence[str]) -> PlanRequest:
    """The ``PlanRequest`` that ``longstraw plan ARGV`` (without ``--config``) plans: for scripts that tabulate plans,
    such as ``bench.planner``, so that their rows are the commands README shows."""
    args = build_parser().parse_args(["plan", *argv])
    if args.config is not None:
        raise ValueError("flags_plan_request: the flags' job only (no --config)")
    return _flags_request(args, _flags_job(args))


def _flags_job(args: argparse.Namespace) -> dict[str, Any]:
    """The job of the flags: each given flag, the published configuration's value where it is silent."""
    return {
        name: default if getattr(args, name) is None else getattr(args, name)
        for name, (_, default) in _JOB_FLAGS.items()
    }


def _flags_shape(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    """The workload's shape and the mesh (``PlanShape``'s fields), checked without torch."""
    return dict(
        model=job["model"], context=_quantity("2.1M") if args.context is None else args.context, group=job["group"],
        completion=job["completion"], history=args.history, turns=args.turns, gpus=job["gpus"],
        gpu_mem_bytes=args.gpu_mem, cp=job["cp"], dp=job["dp"], fsdp=job["fsdp"], mode=job["mode"],
        optimizer=job["optimizer"], offload=job["offload"], beta=job["beta"], cp_rank=args.cp_rank,
        groups_per_rank=job["groups_per_rank"], hsdp=job["hsdp"], expert_parallel=job["expert_parallel"],
        expert_dispatch=job["expert_dispatch"],
    )  # fmt: skip


def _flags_request(args: argparse.Namespace, job: dict[str, Any]) -> PlanRequest:
    import torch

    from longstraw_agents.job import extends_may_shard
    from longstraw_agents.plan import PLAN_ENGINE, PlanRequest

    shape = _flags_shape(args, job)
    sharded_extends = extends_may_shard(shape["expert_parallel"], shape["expert_dispatch"])
    engine = PLAN_ENGINE.updated(**_engine_flags(args), sharded_extends=sharded_extends)
    return PlanRequest(
        **shape, dtype=getattr(torch, job["dtype"]), engine=engine,
        mixed_precision=False if job["no_mixed_precision"] else None,
    )  # fmt: skip


def _engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the flags give (the others: ``PLAN_ENGINE``'s)."""
    given = {
        "chunk_size": args.chunk,
        "checkpoint_every": args.checkpoint_every,
        "graph_budget_bytes": args.graph_budget,
        "activation_checkpointing": args.activation_checkpointing,
        "wavefront_walk": None if args.walk is None else args.walk == "wavefront",
        "balanced_captures": None if args.capture is None else args.capture == "balanced",
    }
    return {name: value for name, value in given.items() if value is not None}


def _assumed(args: argparse.Namespace, job: dict[str, Any]) -> str:
    """The note that says what a plan without ``--config`` assumed of the job (the flags not given)."""
    silent = set(_JOB_FLAGS) - set(_given_job_flags(args))
    assumed = []
    if "fsdp" in silent:
        assumed.append("FSDP2 over the GPUs (--no-fsdp: every GPU holds the whole model, as parallel.fsdp: false)")
    if silent & {"chunk", "checkpoint_every", "graph_budget", "activation_checkpointing", "walk", "capture"}:
        assumed.append("the engine line's settings (--chunk, --activation-checkpointing...)")
    if silent & {"dtype", "no_mixed_precision"}:
        assumed.append(f"{job['dtype']} compute" + ("" if job["no_mixed_precision"] else " over fp32 masters"))
    if "mode" in silent:
        assumed.append(f"{job['mode']} mode")
    said = f": {'; '.join(assumed)}" if assumed else ""
    return (
        f"no --config: the job of the flags, the published configuration where they are silent{said}; "
        "`longstraw plan --config RUN.yaml` plans the job a run config describes, as `longstraw train` runs it"
    )


def _plan_config(args: argparse.Namespace) -> int:
    """``longstraw plan --config RUN.yaml``: the step ``longstraw train RUN.yaml`` would run."""
    from pydantic import ValidationError

    from longstraw_agents.app.config import TrainConfig, load_config
    from longstraw_agents.app.planning import run_plan_request

    try:
        config = load_config(args.config)
    except ValidationError as err:
        return _fail(_validation_message(err, TrainConfig))
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))

    def request() -> PlanRequest:  # (a ConfigError, the model or tokenizer unreadable, is a ValueError)
        workload = {"context": args.context, "history": args.history, "turns": args.turns, "cp_rank": args.cp_rank}
        return run_plan_request(config, gpu_mem_bytes=args.gpu_mem, **workload)

    return _run_plan(args, request, config_path=args.config)


def _run_plan(
    args: argparse.Namespace,
    make_request: Callable[[], PlanRequest],
    assumed: str | None = None,
    config_path: str | None = None,
) -> int:
    """Plan ``make_request()`` (a ``PlanRequest``), print its table (with the ``assumed`` note), what would fit and
    the time model's phases where asked."""
    from pydantic import ValidationError

    from longstraw_agents.plan import CONTEXT_SEARCH_LIMIT, longest_context, plan_memory

    try:
        request = make_request()
        timed_on = _time_profile(args, request.model) if args.time or args.profile is not None else None
        if args.longest:
            longest, plan = longest_context(request, high=CONTEXT_SEARCH_LIMIT)
            print(_longest_text(longest, CONTEXT_SEARCH_LIMIT))
            request = replace(request, context=max(longest, 1))
        else:
            plan = plan_memory(request)
    except ValidationError as err:
        return _fail(_plan_errors(err))
    except ValueError as err:
        return _fail(str(err))
    if assumed is not None:
        plan.notes.append(assumed)
    print(plan.table())
    if not plan.fits and not args.longest:
        _print_what_fits(request, config_path)
    if timed_on is not None:
        from longstraw_agents.plan import step_time

        try:
            timed = step_time(request, timed_on)
        except ValueError as err:
            return _fail(str(err))
        print()
        print(timed.table())
    return 0


def _print_what_fits(request, config_path: str | None = None) -> None:
    """For a step that does not fit: the layout that does, where there is one to suggest (a mixture of experts
    planned without expert parallelism: expert parallelism and offload, as the published runs), as the flags to add
    or, planning a run config, its settings."""
    from longstraw_agents.plan import GIB, expert_parallel_alternative, plan_memory

    alternative = expert_parallel_alternative(request)
    if alternative is None:
        return
    plan = plan_memory(alternative)
    if not plan.fits:
        return
    added = {
        "expert_parallel": True,
        "offload": not request.offload,
        "hsdp": alternative.hsdp and not request.hsdp,
        "fsdp": not request.fsdp,
    }
    needed = [name for name, needed in added.items() if needed]
    if config_path is None:
        flags, how = " ".join(_flag(name) for name in needed), "add the flags for its plan"
    else:
        flags, how = ", ".join(f"parallel.{name}: true" for name in needed), f"set them in {config_path}"
    print(
        f"with expert parallelism ({flags}) it fits: {plan.total / GIB:.2f} GiB per GPU, each cp rank holding whole "
        f"experts, never gathered ({how})"
    )


def _time_profile(args: argparse.Namespace, model: Any) -> HardwareProfile:
    """``--hardware``'s profile, or with ``--profile`` the one measured there for ``model``'s family (its links
    ``--hardware``'s; ``model``: the plan's, a name, a config file or a transformers config)."""
    from longstraw_agents.plan import PROFILES

    named = PROFILES[args.hardware]
    if args.profile is None:
        return named
    import json
    from pathlib import Path

    from pydantic import ValidationError

    from longstraw_agents.models import adapter_class
    from longstraw_agents.plan import load_config, measured_profile

    try:
        record = json.loads(Path(args.profile).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--profile {args.profile}: {err}") from None
    family = adapter_class(load_config(model)).family
    try:
        return measured_profile(record, family, named)
    except (ValueError, TypeError, ValidationError) as err:
        raise ValueError(f"--profile {args.profile}: {str(err).splitlines()[0]}") from None


def _longest_text(longest: int, limit: int) -> str:
    if not longest:
        return "nothing fits"
    if longest == limit - 1:  # every length the search tried fits: the answer is its bound, not the memory's
        return (
            f"longest context that fits: at least {longest:,} positions (the search's upper bound; longer contexts "
            "were not tried)"
        )
    return f"longest context that fits: {longest:,} positions"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be written when its help is printed (``epilog_from``): ``train``'s lists
    the engine's settings, which takes importing torch, and no other command should pay for that."""

    def __init__(self, *args: Any, epilog_from: Callable[[], str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.epilog_from = epilog_from

    def format_help(self) -> str:
        if self.epilog_from is not None:
            self.epilog = self.epilog_from()
        return super().format_help()


# What ``build_parser`` hands each ``add_*_parser``: the subcommands, each parsed by a ``_Parser``.
Subparsers: TypeAlias = "argparse._SubParsersAction[_Parser]"


def _engine_section_help() -> str:
    """The run config's ``engine:`` section, a setting a paragraph: ``EngineConfig``'s fields, defaults and
    descriptions (the source of truth, so this cannot go stale)."""
    import textwrap

    from longstraw_agents.engine import EngineConfig

    lines = [
        "the config's engine: section (EngineConfig; e.g. `engine: {chunk_size: 4096, activation_checkpointing: "
        "true}`; `longstraw plan --config CONFIG` plans it):"
    ]
    for name, field in EngineConfig.model_fields.items():
        entry = f"{name} (default {field.default!r}): {field.description}"
        lines.append(textwrap.fill(entry, width=100, initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longstraw",
        description="Long-context GRPO for agents: list environments, train, replay logged episodes offline, "
        "inspect and view trajectory stores, plot runs, export and serve policies.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="what to do (`longstraw COMMAND --help`: its options)",
        parser_class=_Parser,
    )
    for add_parser in (
        add_envs_parser,
        add_inspect_parser,
        add_train_parser,
        add_replay_parser,
        add_plot_parser,
        add_export_parser,
        add_serve_parser,
        add_view_parser,
        add_plan_parser,
    ):
        add_parser(subparsers)
    return parser


def add_envs_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("envs", help="list the registered LongStraw environments")
    p.set_defaults(func=_cmd_envs)


def add_inspect_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("inspect", help="summarise a trajectory store (SQLite)")
    p.add_argument("db", help="path to a store written by longstraw")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--episode", type=int, default=None, help="show one episode's transcript")
    shown.add_argument("--group", default=None, help="show the transcripts of one group")
    p.add_argument("--transcript", action="store_true", help="print transcripts of all shown episodes")
    p.add_argument(
        "--where", default=None, help='SQL condition on the episodes table, e.g. "reward > 0 AND policy_version >= 3"'
    )
    p.add_argument("--max-text", type=int, default=120, help="cut segment text to this many characters (0: never)")
    p.set_defaults(func=_cmd_inspect)


def add_train_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="online GRPO: rollout -> store -> GRPO step -> metrics -> checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog_from=_engine_section_help,
    )
    p.add_argument("config", help="YAML or TOML training config (see README)")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its checkpoint")
    p.add_argument("--output-dir", default=None, help="override the config's output_dir")
    p.add_argument("--steps", type=int, default=None, help="override the config's number of steps")
    p.add_argument("--seed", type=int, default=None, help="override the config's seed (a run of another seed)")
    p.add_argument(
        "--check",
        action="store_true",
        help="dry run: validate the config (schema, paths, vocabularies, env, output_dir, parallel against this "
        "launch, showing the mesh, the served policy's server) without a GPU, loading no weights and writing "
        "nothing, and print the step's memory plan (`longstraw plan --config`'s); exit 0 if it would run, 2 otherwise",
    )
    p.add_argument(
        "--no-plan",
        dest="plan",
        action="store_false",
        help="--check without the memory plan (seconds for a large model)",
    )
    p.set_defaults(func=_cmd_train)


def add_replay_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("replay", help="offline GRPO over logged episodes of a store")
    p.add_argument("db", help="trajectories.db of a run")
    p.add_argument(
        "--where",
        default=None,
        help='SQL condition on episodes, e.g. "reward > 0 AND policy_version >= 3"; keeps every group with at least '
        "one matching episode whole (unmatched members included: a group learns from its reward differences); "
        "with --fork-at it selects the episodes to fork from",
    )
    p.add_argument("--run", default=None, help="run directory with config.json + checkpoint (default: the DB's)")
    p.add_argument("--out", default=None, help="output run directory, must not hold a run (default: RUN/replay)")
    p.add_argument("--steps", type=int, default=1, help="passes over the selected groups")
    p.add_argument("--groups-per-step", type=int, default=4, help="groups per optimizer step (default 4)")
    p.add_argument("--max-staleness", type=int, default=None, help="skip episodes this many versions older")
    p.add_argument("--keep-stale", action="store_true", help="keep stale episodes, flagged in the metrics")
    p.add_argument("--tis-cap", type=float, default=2.0, help="cap of the truncated importance weights")
    p.add_argument("--fork-at", type=int, default=None, help="fork new groups from this logged assistant turn")
    p.add_argument("--fork-group-size", type=int, default=4, help="continuations per forked group")
    p.add_argument(
        "--recorded-tools",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--fork-at: give the replayed turns' tool calls their logged results (default), or run the tools "
        "again and check their output against the log token for token (--no-recorded-tools; for stateful tools)",
    )
    p.set_defaults(func=_cmd_replay)


def add_plot_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("plot", help="reward / loss / length / memory curves of a run directory")
    p.add_argument("run_dir", help="a run directory (its metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: the run directory)")
    p.set_defaults(func=_cmd_plot)


def add_export_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a run's checkpoint (also an FSDP2 run's shards) as a Hugging Face model"
    )
    p.add_argument("run_dir", help="a run directory (config.json + checkpoint/)")
    p.add_argument("out", help="the directory to write: model and tokenizer (from_pretrained reads both)")
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty OUT (files of the same name are replaced)"
    )
    p.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: write the model with the adapter merged in (default: the adapter, in PEFT's format)",
    )
    p.set_defaults(func=_cmd_export)


def add_serve_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a policy over the OpenAI API (chat completions with tool calls, completions)"
    )
    p.add_argument(
        "path", metavar="MODEL_DIR|RUN_DIR", help="a Hugging Face model directory with its tokenizer, or a run"
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (0: a free one, printed)")
    p.add_argument("--model-name", default=None, help="the name clients ask for (default: the path as given)")
    p.add_argument(
        "--weight-version", type=int, default=None, help="the version reported (default: the run's policy version, 0)"
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float64"], default=None, help="default: the run's, float32"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when there is a GPU)")
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help="a request's max_tokens at most; above it, a 400 (default 16,384; the context minus the prompt bounds "
        "it too)",
    )
    p.add_argument(
        "--memory-budget",
        type=_positive_quantity,
        default=None,
        help="bytes of decoding state the requests in flight may hold together, each counted at its most, e.g. 8G "
        "(default: half the memory free on the device at start); a request beyond it waits, then gets a 503",
    )
    p.add_argument(
        "--queue-timeout",
        type=_positive_float,
        default=None,
        help="seconds a request waits for room in the memory budget before a 503 (default 60)",
    )
    p.set_defaults(func=_cmd_serve)


def add_view_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "view", help="groups as prefix trees in the browser: a self-contained HTML page, or a loopback server"
    )
    p.add_argument("path", metavar="RUN_DIR|DB", help="a run directory (its store and metrics.jsonl) or a store")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--group", default=None, help="one group id, e.g. step3-g1 (in every run that has it)")
    chosen.add_argument(
        "--where", default=None, help='SQL condition on episodes, e.g. "reward > 0"; keeps matching groups whole'
    )
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--out", default=None, help="the HTML file to write (default: view.html beside the store)")
    shown.add_argument("--serve", action="store_true", help="serve on 127.0.0.1 instead, loading groups on demand")
    p.add_argument("--port", type=_port, default=8765, help="--serve: the port (0: a free one, printed)")
    p.add_argument(
        "--max-groups", type=int, default=None, help="groups the HTML file embeds, the first selected (default 20)"
    )
    p.add_argument("--tokenizer", default=None, help="decode tokens with this tokenizer instead of the run's")
    p.set_defaults(func=_cmd_view)


def add_plan_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan the peak memory per GPU of a GRPO step (no GPU, no weights needed): of a run config (--config), or "
        "of the job the flags describe",
    )
    _add_plan_job_arguments(p)
    _add_plan_layout_arguments(p)
    _add_plan_training_arguments(p)
    _add_plan_engine_arguments(p)
    _add_plan_answer_arguments(p)
    p.set_defaults(func=_cmd_plan)


def _add_plan_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job: the model, the step's sizes (context, group, completions, an agent's history), or a run config."""
    p.add_argument(
        "--config", default=None,
        help="plan the step `longstraw train CONFIG` would run (its model, parallel layout, engine, dtype, mode, G, "
        "completions of sampling.max_new_tokens; the model's context unless --context): the flags that describe the "
        "job are then the file's",
    )  # fmt: skip
    p.add_argument(
        "--model",
        default=None,
        help="qwen3.6-27b (default) | glm-5.2 | tiny-<preset> | CONFIG.json (a transformers config)",
    )
    p.add_argument(
        "--context",
        type=_quantity,
        default=None,
        help="shared prompt positions, e.g. 2.1M (default 2.1M, with --config the model's context; not with --longest)",
    )
    p.add_argument("--group", type=int, default=None, help="G: completions per prompt (default 8)")
    p.add_argument(
        "--groups-per-rank", type=int, default=None,
        help="groups a dp rank trains in one optimizer step (a later group's capture holds the earlier gradients)",
    )  # fmt: skip
    p.add_argument(
        "--completion", type=_quantity, default=None, help="tokens per completion (agents: per answer; default 1024)"
    )
    p.add_argument(
        "--history", type=_quantity, default=0,
        help="agents: each member's own history after the shared context (tool outputs and answers), e.g. 1M",
    )  # fmt: skip
    p.add_argument("--turns", type=int, default=1, help="agents: turns in which the history grows")


def _add_plan_layout_arguments(p: argparse.ArgumentParser) -> None:
    """How the GPUs split: dp x cp, FSDP2 or not, expert parallelism, the cp rank planned."""
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all: dp x cp (default 8)")
    p.add_argument("--gpu-mem", type=_quantity, default=_quantity("96GB"), help="memory per GPU, e.g. 96GB")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks (default: gpus / dp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: gpus / cp, or 1)")
    p.add_argument(
        "--fsdp", action=argparse.BooleanOptionalAction, default=None,
        help="FSDP2 over the GPUs (parallel.fsdp; default on, the published layout); --no-fsdp: every GPU holds the "
        "whole model, its gradients and AdamW's state",
    )  # fmt: skip
    p.add_argument(
        "--hsdp", action="store_true", default=None,
        help="shard over each dp rank's cp GPUs, replicated over dp (parallel.hsdp): a layer at a time at dp > 1 too",
    )  # fmt: skip
    p.add_argument(
        "--expert-parallel", action="store_true", default=None,
        help="each cp rank holds whole experts, never gathered, and computes every extend replicated unless "
        "--expert-dispatch (parallel.expert_parallel; a mixture of experts, dp = 1 or --hsdp)",
    )  # fmt: skip
    p.add_argument(
        "--expert-dispatch", action="store_true", default=None,
        help="with --expert-parallel: long extends sharded, each MoE call sending its tokens to their experts' "
        "ranks by all-to-all (parallel.expert_dispatch); exact mode walks replicated",
    )  # fmt: skip
    p.add_argument(
        "--cp-rank", type=int, default=None,
        help="the cp rank to plan (default: per term the rank holding the most: rank 0 of a balanced capture, the "
        "last in rank order)",
    )  # fmt: skip


def _add_plan_training_arguments(p: argparse.ArgumentParser) -> None:
    """The step: its mode, dtype and precision, optimizer (and its offload) and KL weight."""
    p.add_argument(
        "--mode", choices=["detached", "exact"], default=None,
        help="the prefix's gradient: dropped (detached, as published; the default) or exact (the reverse walk)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default=None,
        help="the compute dtype (default bfloat16; narrower than fp32: fp32 master weights, see --no-mixed-precision)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", choices=["adamw", "none"], default=None,
        help="adamw: its two moments per parameter, in the masters' dtype (default); none: no optimizer state",
    )  # fmt: skip
    p.add_argument(
        "--offload", action="store_true", default=None,
        help="FSDP2's CPU offload (parallel.offload): master shards, their gradients and AdamW state on the host",
    )  # fmt: skip
    p.add_argument(
        "--no-mixed-precision",
        action="store_true",
        default=None,
        help="AdamW steps the --dtype weights themselves (default for bf16/fp16: fp32 master weights, as "
        "trainer.mixed_precision runs)",
    )
    p.add_argument("--beta", type=float, default=None, help="KL weight: > 0 plans the reference model too")


def _add_plan_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's settings (``PLAN_ENGINE``'s where the flags are silent)."""
    p.add_argument(
        "--chunk", type=_quantity, default=None, help="engine chunk size (engine.chunk_size; default 4096 in plans)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="recurrent checkpoint spacing (exact; engine.checkpoint_every)",
    )
    p.add_argument(
        "--graph-budget", type=_quantity, default=None, help="exact mode's kept-graph budget in bytes (default 0)"
    )
    p.add_argument(
        "--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
        help="recompute layers in backward (default on in plans: large models' branch graphs otherwise dominate; "
        "engine.activation_checkpointing, off in a run unless its config sets it)",
    )  # fmt: skip
    p.add_argument(
        "--walk", choices=["wavefront", "replicated"], default=None,
        help="exact mode over cp ranks: sharded walk keeping layer inputs (default), or every rank recomputing every "
        "chunk (engine.wavefront_walk)",
    )  # fmt: skip
    p.add_argument(
        "--capture", choices=["balanced", "rank-order"], default=None,
        help="how a sharded capture, and exact mode's wavefront walk, is cut over cp ranks: even attention work "
        "(the default; each layer gathered once per wave of runs: cp layers whole on every rank; the walk's segments "
        "and gradients held up to cp - 1 layers longer), or in rank order (the last rank's work up to twice the "
        "mean; 1 + r layers whole on rank r; engine.balanced_captures)",
    )  # fmt: skip


def _add_plan_answer_arguments(p: argparse.ArgumentParser) -> None:
    """What to answer besides the plan: the longest context that fits, the step's time."""
    p.add_argument("--longest", action="store_true", help="search the longest context that fits instead")
    p.add_argument("--time", action="store_true", help="also the step's time by phase (the time model)")
    p.add_argument(
        "--hardware", choices=["h200", "h100", "h20"], default="h200", help="the GPU --time models (default h200)"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="--time with the rates measured in this record of bench/gpu.py (e.g. bench/results/gpu.json: the "
        "model family's profile; --hardware gives the links)",
    )


# What a shell reports for a program killed by SIGPIPE (128 + 13): `longstraw inspect DB | head` ends like `cat`.
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that left shows up here, not as a traceback at interpreter exit
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it again at exit raises nothing (Python's documented recipe for
    a closed pipe)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured or replaced): nothing will flush to a pipe
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
