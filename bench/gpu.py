"""Long-context figures on one accelerator: each single-GPU phase of a GRPO step, for three model families (bf16).

Families at the same hidden size and depth, about 1B parameters each: ``hybrid`` (the Qwen3.6-27B layout, 3
GatedDeltaNet : 1 gated attention), ``dense`` (Qwen3: full attention in every layer) and ``mla`` (the GLM-5.2
layout: MLA + DSA + a small MoE). For each family and context length P (the group's shared context: the prompt has
P + 1 tokens, its last one being each completion's first input, as in the trainer's prefix tree), one row per phase:

- ``capture``: ``Engine.capture`` of the P context tokens (no graph);
- ``scoring``: log-probs of the G completions from the captured state, no graph — the trainer's reference log-probs
  (``ExecutionMode.node_loss``: ``Engine.hidden`` from the parent's state, then ``Head.logprobs``), per leaf of the
  group's prefix tree;
- ``replay``: detached mode's branch replays alone (forward + backward of the G completions from the constant
  context state), timed directly: ``backward_group(..., "detached", prefix_cache=...)`` with the cache holding the
  captured state, so the mode extends nothing (``GRPOConfig.capture_reuse``'s path);
- ``decode``: ``Decoder`` steps of the G members sharing the captured prefix, fixed random tokens fed (tokens/s =
  G x steps / s), their states written out at the end as a sampler's ``leave`` does: captured in CUDA graphs on a
  GPU (their capture included), and as ``decode_eager`` the eager step beside it (``--no-decode-eager``: not);
- at the lengths in ``--exact-at`` only: ``detached_step``, ``grpo_backward(..., "detached")`` (capture +
  replays: on one H200 it came within 1.5 % of their sum at every length, so elsewhere it would only repeat the
  capture), ``exact_step``, ``grpo_backward(..., "exact")`` (the gradient through the whole context), and ``walk``,
  exact_step − detached_step: what the reverse walk through the context adds (a difference, not a measurement: its
  row says so in ``difference_of`` and has no peak).

Each phase is timed with the device synchronised around it, with its peak allocated memory (CUDA; None on CPU).
Each family runs every phase once at two chunks first (decoding two steps), untimed: kernel compilation and
autotuning. Every row also carries the context state's bytes, measured and as ``state_size`` predicts, and beside
the engine's time (``Beside``):

- ``peer_s``: transformers' own model (the same weights) doing the same work on the same device, in the same run
  (``bench/peers_gpu.py``: capture <-> ``model.model`` with ``use_cache=True``, scoring and replay <-> the G
  completions over the context's cache, decode <-> ``generate``), its kernels and workarounds in ``peer_impl``, and
  ``peer_ratio`` = engine / transformers (the target: at most 1);
- ``model_flops``: the phase's FLOPs as the time model counts them (``longstraw_agents.plan.timing`` through
  ``bench.workloads.row_work``), ``flops_per_s`` and ``of_matmul``, that rate over the run's bf16 matmul rate
  (``bench.ceilings.matmul_rate`` at a chunk x hidden x 3 hidden product, measured once at the start);
- ``predicted_s`` and ``predicted_over_measured``: the time model's seconds from the family's profile, measured op
  by op in the same run (``bench.ceilings``; the profile is in the record's ``setup``, for ``plan --time
  --profile``);
- ``kernels_off``: the kernels a failed GPU parity test switched off for the row (``--gpu-tests``,
  ``bench/gpu_tests.py``).

The record (``--out``) is written row by row (``bench/gpu_record.py``), with the device, date, versions and the GPU
tests' verdict per kernel; ``--budget-s`` starts no phase after that many seconds and lists what it left out under
``skipped``, as it does a phase that ran out of memory. ``bench/gpu.sh`` runs it on a GPU machine; ``--device cpu
--quick`` runs the same code at toy sizes (the suite's smoke test).

    python -m bench.gpu [--families hybrid dense mla] [--lengths 32768 131072] [--exact-at 32768] [--quick]
        [--mla-lengths 32768] [--mla-exact-at] [--gpu-tests gpu_tests.xml] [--budget-s 300 | --until EPOCH] [--no-peers]
    python -m bench.gpu --table bench/results/gpu.json   # the record as README's table
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.ceilings import SharedRates, dsa_rooflines, measure_profile
from bench.gpu_record import BudgetSpent, Deadline, Record, now
from bench.gpu_tests import KernelSwitch, attention_backend, read_junit, switched_off, verdicts
from bench.peers_gpu import PeerWork, Transformers
from bench.workloads import FAMILIES, STEPS, VOCAB, Workload, build, decode, engine_config, replay, row_work, score
from longstraw_agents.attention import BACKEND_NAMES
from longstraw_agents.engine import Engine
from longstraw_agents.models import state_size
from longstraw_agents.plan import HardwareProfile, ModelWork
from longstraw_agents.state import State
from longstraw_agents.trainer import LossConfig, grpo_backward

RESULTS = Path(__file__).parent / "results"


@dataclass
class Timing:
    seconds: float = 0.0
    peak: int | None = None


@contextmanager
def clock(device: torch.device) -> Iterator[Timing]:
    """Wall time and peak allocated accelerator memory of a block (the device synchronised around it)."""
    timing = Timing()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    yield timing
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        timing.peak = torch.cuda.max_memory_allocated(device)
    timing.seconds = time.perf_counter() - start


def timed(fn: Callable[[], Any], model: torch.nn.Module, device: torch.device, repeats: int) -> tuple[Timing, Any]:
    """The median of ``repeats`` timings of ``fn()`` (its largest peak) and its last result; the model's gradients
    are cleared before each."""
    timings, result = [], None
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        with clock(device) as timing:
            result = fn()
        timings.append(timing)
    peaks = [t.peak for t in timings if t.peak is not None]
    return Timing(statistics.median(t.seconds for t in timings), max(peaks) if peaks else None), result


def planned_phases(positions: int, exact_at: list[int], decode_eager: bool = True) -> list[str]:
    """The rows measured at a context of ``positions``, in order."""
    steps = ["detached_step", "exact_step", "walk"] if positions in exact_at else []
    return ["capture", "scoring", "replay", "decode", *(["decode_eager"] if decode_eager else []), *steps]


Row = dict[str, Any]


class PhaseFailed(Exception):
    """A phase could not be measured (out of memory, a kernel failed): the row is skipped, with the reason."""


def failure(err: BaseException) -> str:
    """One line for an exception a phase raised (the traceback printed, for the log, unless it ran out of memory)."""
    if isinstance(err, torch.OutOfMemoryError):
        return f"out of memory: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    traceback.print_exception(err)
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]


def measure_phases(
    model: torch.nn.Module,
    engine: Engine,
    positions: int,
    args: argparse.Namespace,
    on_row: Callable[[Row], None] | None = None,
    beside: Beside | None = None,
    deadline: Deadline | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> list[Row]:
    """One row per phase of a GRPO step over a context of ``positions`` tokens (see the module's docstring), each
    also passed to ``on_row`` as soon as it is measured; the family is the engine's (``hybrid``, ``dense``,
    ``mla``). ``beside`` adds transformers' time for the same work and the row's FLOP rate and predicted time;
    ``deadline``: ``BudgetSpent`` is raised before a phase that would start after it; a phase that runs out of
    memory is passed to ``on_skip`` with the reason, and so are the phases that needed it."""
    device = engine.adapter.device
    parameters = sum(p.numel() for p in model.parameters())
    analytic_state = state_size(model.config, engine.adapter.dtype).total(positions)
    work = Workload.random(positions, args, device)
    group = work.group()
    scored = args.group * args.completion
    rows: list[Row] = []
    state_bytes = 0
    if beside is not None:
        beside.start(work)

    def row(phase: str, timing: Timing, tokens: int, difference_of: list[str] | None = None) -> None:
        r: Row = {
            "family": engine.family,
            "parameters": parameters,
            "positions": positions,
            "phase": phase,
            "seconds": timing.seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / timing.seconds if timing.seconds > 0 else None,
            "peak_bytes": timing.peak,
            "difference_of": difference_of,
            "state_bytes": state_bytes,
            "state_bytes_analytic": analytic_state,
        }
        if beside is not None:
            r |= beside.extras(r)
        rows.append(r)
        if on_row is not None:
            on_row(r)

    def measured(phase: str, fn: Callable[[], Any]) -> tuple[Timing, Any]:
        if deadline is not None:
            deadline.check()
        try:
            return timed(fn, model, device, args.repeats)
        except Exception as err:  # out of memory, or a kernel's failure: the run goes on without the phase
            model.zero_grad(set_to_none=True)
            free(device)
            raise PhaseFailed(failure(err)) from None

    def skipped(phase: str, reason: str) -> None:
        if on_skip is not None:
            on_skip(phase, reason)

    def from_the_context(state: State) -> None:
        """The phases that start from the captured context (its state freed when they are done)."""
        phases = {
            "scoring": (lambda: score(engine, group, state), scored),
            "replay": (lambda: replay(engine, group, state), scored),
            "decode": (lambda: decode(engine, state, work.decode_tokens), work.decode_tokens.numel()),
        }
        if args.decode_eager:  # the eager step beside the captured one, for comparison
            phases["decode_eager"] = (
                lambda: decode(engine, state, work.decode_tokens, graphs=False),
                work.decode_tokens.numel(),
            )
        for phase, (fn, tokens) in phases.items():
            try:
                row(phase, measured(phase, fn)[0], tokens)
            except PhaseFailed as failed:
                skipped(phase, str(failed))

    try:
        with torch.no_grad():
            timing, captured = measured("capture", lambda: engine.capture(work.prompt[:-1]))
    except PhaseFailed as failed:
        for phase in planned_phases(positions, args.exact_at, args.decode_eager):
            skipped(phase, str(failed) if phase == "capture" else "needs the capture")
        return rows
    state_bytes = captured.nbytes
    row("capture", timing, positions)
    from_the_context(captured)
    del captured
    if beside is not None:
        beside.finish()
    if positions not in args.exact_at:
        return rows
    steps = {}
    for mode in ("detached", "exact"):
        fn = lambda mode=mode: grpo_backward(engine, work.prompt, work.completions, work.rewards, mode)  # noqa: E731
        try:
            timing, _ = measured(f"{mode}_step", fn)
        except PhaseFailed as failed:
            skipped(f"{mode}_step", str(failed))
            continue
        row(f"{mode}_step", timing, positions + scored)
        steps[mode] = timing.seconds
    model.zero_grad(set_to_none=True)
    if len(steps) < 2:
        skipped("walk", "needs both steps")
        return rows
    row("walk", Timing(steps["exact"] - steps["detached"]), positions, ["exact_step", "detached_step"])
    return rows


# --- beside each row: transformers' time, the FLOP rate, the time model's prediction ------------------------------

PEER_PHASES = ("capture", "scoring", "replay", "decode")


@dataclass
class Beside:
    """What each of a family's rows gets beside the engine's time: transformers' seconds for the same work on the same
    device (``bench/peers_gpu.py``; ``peer_ratio`` = engine / transformers), the model FLOPs the time model counts for
    the phase (``bench.workloads.row_work``: ``longstraw_agents.plan.timing``'s count) per second and against the run's
    matmul rate, the time model's seconds from the family's micro-benchmarked profile (``predicted_over_measured``)
    and the kernels switched off by a failed GPU test."""

    model: torch.nn.Module
    args: argparse.Namespace
    peer: Transformers | None = None
    profile: HardwareProfile | None = None
    matmul_rate: float | None = None
    kernels_off: tuple[KernelSwitch, ...] = ()
    deadline: Deadline | None = None
    _work: PeerWork | None = None
    _cache: Any = None
    _peer_error: str | None = None
    _counted: ModelWork | None = field(default=None, repr=False)

    def start(self, work: Workload) -> None:
        self._work = PeerWork.of(work.prompt, work.completions, work.rewards, work.decode_tokens.shape[0])
        self._cache, self._peer_error = None, None

    def finish(self) -> None:
        self._cache = None
        free(next(self.model.parameters()).device)

    def extras(self, row: Row) -> Row:
        out: Row = {
            "kernels_off": [s.kernel for s in self.kernels_off if s.applies_to(row["family"], row["phase"])],
            **self.model_columns(row),
        }
        return out | self.peer_columns(row)

    def model_columns(self, row: Row) -> Row:
        """The row's model FLOPs (as the time model counts the phase's work), their rate and its share of the run's
        matmul rate, and the time model's seconds from the family's profile (None for a phase it does not model)."""
        out: Row = dict.fromkeys(("model_flops", "flops_per_s", "of_matmul", "predicted_s", "predicted_over_measured"))
        if row["phase"] not in STEPS:
            return out
        if self._counted is None:
            self._counted = ModelWork.of(self.model.config, self.model.dtype)
        work = row_work(row, self._counted, self.args)
        out["model_flops"] = work.flops
        if self.profile is not None:
            out["predicted_s"] = self.profile.time(work)
        if row["seconds"] > 0:  # (a difference of two phases can come out at zero or below on a busy machine)
            out["flops_per_s"] = work.flops / row["seconds"]
            out["of_matmul"] = out["flops_per_s"] / self.matmul_rate if self.matmul_rate else None
            if out["predicted_s"] is not None:
                out["predicted_over_measured"] = out["predicted_s"] / row["seconds"]
        return out

    def peer_columns(self, row: Row) -> Row:
        """transformers' time for the row's work: ``peer_s``, ``peer_ratio`` (engine / transformers), its peak
        memory, its kernels (``peer_impl``) and why it has none (``peer_error``)."""
        out: Row = dict.fromkeys(("peer_s", "peer_ratio", "peer_peak_bytes", "peer_impl", "peer_error"))
        if self.peer is None or row["phase"] not in PEER_PHASES or self._work is None:
            return out
        phase, device = row["phase"], next(self.model.parameters()).device
        if phase in self.peer.left_out:
            return out | {"peer_error": self.peer.left_out[phase]}
        if self._peer_error is not None and phase != "capture":
            return out | {"peer_error": self._peer_error}
        if self.deadline is not None and self.deadline.passed:
            return out | {"peer_error": "time budget spent"}
        runs: dict[str, Callable[[], Any]] = {
            "capture": lambda: self.peer.capture(self._work),
            "scoring": lambda: self.peer.scoring(self._cache, self._work),
            "replay": lambda: self.peer.replay(self._cache, self._work),
            "decode": lambda: self.peer.decode(self._cache, self._work),
        }
        while True:
            try:
                timing, result = timed(runs[phase], self.model, device, self.args.repeats)
                break
            except Exception as err:  # out of memory (then again in smaller pieces), or a kernel's failure
                self.model.zero_grad(set_to_none=True)
                if not (isinstance(err, torch.OutOfMemoryError) and self.peer.smaller(phase)):
                    error = failure(err)
                    if phase == "capture":
                        self._peer_error = f"no cache of the context: transformers' capture failed ({error})"
                    free(device)
                    return out | {"peer_error": error, "peer_impl": self.peer.label(phase)}
        self.model.zero_grad(set_to_none=True)
        if phase == "capture":
            self._cache = result
        return out | {
            "peer_s": timing.seconds,
            "peer_ratio": row["seconds"] / timing.seconds if timing.seconds > 0 else None,
            "peer_peak_bytes": timing.peak,
            "peer_impl": self.peer.label(phase),
        }


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def figure(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


HEADER = (
    f"{'family':>7} {'params':>7} {'positions':>9} {'phase':>13} {'seconds':>8} {'tokens/s':>10} {'peak GiB':>8} "
    f"{'state MiB':>9} {'meas/an.':>8} {'HF s':>8} {'eng/HF':>6} {'TFLOP/s':>8} {'of mm':>6} {'pred/meas':>9}"
)


def format_row(r: Row) -> str:
    rate = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
    phase = f"{r['phase']}*" if r["difference_of"] else r["phase"]
    flops = None if r.get("flops_per_s") is None else r["flops_per_s"] / 1e12
    return (
        f"{r['family']:>7} {r['parameters'] / 1e6:>6.1f}M {r['positions']:>9} {phase:>13} {r['seconds']:>8.3f} "
        f"{rate:>10} {gib(r['peak_bytes']):>8} {r['state_bytes'] / 2**20:>9.1f} "
        f"{r['state_bytes'] / r['state_bytes_analytic']:>8.3f} {figure(r.get('peer_s'), '.3f'):>8} "
        f"{figure(r.get('peer_ratio'), '.2f'):>6} {figure(flops, '.3g'):>8} {figure(r.get('of_matmul'), '.2f'):>6} "
        f"{figure(r.get('predicted_over_measured'), '.2f'):>9}"
        + (f"  [off: {', '.join(r['kernels_off'])}]" if r.get("kernels_off") else "")
        + (f"  [HF: {r['peer_error']}]" if r.get("peer_error") else "")
    )


def context(positions: int) -> str:
    return f"{positions // 1024}K" if positions % 1024 == 0 else str(positions)


def summary(record: dict[str, Any]) -> str:
    """The run's targets at a glance: per family, each capture's and whole step's predicted / measured and every
    phase's engine / transformers."""
    lines = []
    for family in record["setup"]:
        mine = [r for r in record["rows"] if r["family"] == family]
        predicted = [
            f"{r['phase']} {context(r['positions'])} {r['predicted_over_measured']:.2f}"
            for r in mine
            if r["phase"] in ("capture", "detached_step", "exact_step") and r.get("predicted_over_measured")
        ]
        peers = [f"{r['phase']} {context(r['positions'])} {r['peer_ratio']:.2f}" for r in mine if r.get("peer_ratio")]
        lines.append(f"{family}: time model / measured: {', '.join(predicted) or '-'}")
        lines.append(f"{family}: engine / transformers: {', '.join(peers) or '-'}")
    return "\n".join(lines)


def markdown(record: dict[str, Any]) -> str:
    """The record as README's table: each row's seconds beside transformers' for the same work, the FLOP rate against
    the run's matmul rate, the time model's prediction, the peak memory."""
    head = (
        f"{record['device']}, {record['date']} (torch {record['versions']['torch']}, transformers "
        f"{record['versions']['transformers']}, fla {record['versions']['fla']}); {record['args']['dtype']} matmul "
        f"{record.get('matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s"
    )
    lines = [
        head,
        "",
        "| family | context | phase | seconds | tokens/s | transformers s | engine ÷ transformers | TFLOP/s "
        "| of matmul | predicted ÷ measured | peak GiB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        flops = None if r.get("flops_per_s") is None else r["flops_per_s"] / 1e12
        cells = [
            r["family"], f"{r['positions']:,}", r["phase"] + (" (difference)" if r["difference_of"] else ""),
            f"{r['seconds']:.3f}", figure(r["tokens_per_s"], ",.0f"), figure(r.get("peer_s"), ".3f"),
            figure(r.get("peer_ratio"), ".2f"), figure(flops, ".0f"), figure(r.get("of_matmul"), ".2f"),
            figure(r.get("predicted_over_measured"), ".2f"), gib(r["peak_bytes"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"- skipped {s['family']} {s['positions']:,} {s['phase']}: {s['reason']}" for s in record["skipped"]]
    return "\n".join(lines)


def free(device: torch.device) -> None:
    """The accelerator's cached blocks back to it, the cycles holding tensors collected first (nothing on a CPU)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def lengths_of(family: str, args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The family's context lengths and those with whole steps (``--mla-lengths`` / ``--mla-exact-at`` for MLA)."""
    if family != "mla":
        return args.lengths, args.exact_at
    lengths = args.lengths if args.mla_lengths is None else args.mla_lengths
    return lengths, args.exact_at if args.mla_exact_at is None else args.mla_exact_at


# a family's set-up (build, warm-up, micro-benchmarks: 10-40 s on one H200) starts only with this much budget left
SETUP_RESERVE_S = 30.0


@dataclass
class Run:
    """One run's settings, device, record, budget, the kernels switched off and the rates measured once for all
    families (the matmul rate the rows' FLOP rates are set against among them)."""

    args: argparse.Namespace
    device: torch.device
    device_name: str
    record: Record
    deadline: Deadline
    kernels_off: tuple[KernelSwitch, ...]
    shared: SharedRates

    def skip_all(self, family: str, reason: str, done: set[tuple[int, str]]) -> None:
        """Every planned row of ``family`` not yet in ``done``, skipped for ``reason``."""
        lengths, exact_at = lengths_of(family, self.args)
        for positions in lengths:
            for phase in planned_phases(positions, exact_at, self.args.decode_eager):
                if (positions, phase) not in done:
                    self.record.skip(family, positions, phase, reason)
                    done.add((positions, phase))

    def family(self, family: str) -> None:
        """The family's rows at every length, written as measured, after its build, warm-up (untimed: kernel
        compilation and autotuning, the peer's too) and kernel micro-benchmarks (``bench.ceilings``: the time
        model's profile), whose seconds and rates go to the record's ``setup``."""
        args, device, done = self.args, self.device, set()
        lengths, exact_at = lengths_of(family, args)
        family_args = argparse.Namespace(**{**vars(args), "exact_at": exact_at})
        try:
            self.deadline.check(SETUP_RESERVE_S if self.device.type == "cuda" else 0.0)
            start = time.perf_counter()
            model = build(family, args, device)
            engine = Engine(model, engine_config(args))
            built = time.perf_counter()
            peer = Transformers.prepare(model, args.chunk, LossConfig().temperature) if args.peers else None
            prepared = time.perf_counter()
            beside = Beside(model, args, peer, None, self.shared.matmul, self.kernels_off)
            steps = [2 * args.chunk] if exact_at else []  # (whole steps warmed up only where some are timed)
            warm_up = argparse.Namespace(**{**vars(args), "exact_at": steps, "decode_tokens": 2})
            measure_phases(model, engine, 2 * args.chunk, warm_up, beside=beside)
            warm = time.perf_counter()
            beside.profile = measure_profile(family, args, device, self.device_name, self.shared)
            rooflines = dsa_rooflines(args, device, self.shared) if family == "mla" else None
        except BudgetSpent:
            self.skip_all(family, "time budget spent before the family's set-up", done)
            return
        except Exception as err:  # out of memory, a kernel's failure: the other families still run
            free(device)
            self.skip_all(family, f"set-up failed: {failure(err)}", done)
            return
        setup = {
            "build_s": built - start,
            "peer_setup_s": prepared - built,
            "warm_up_s": warm - prepared,
            "ceilings_s": time.perf_counter() - warm,
            "profile": beside.profile.model_dump(),
            "peer": peer.setup if peer is not None else None,
            "rooflines": rooflines,
            "kernels_off": [s.kernel for s in self.kernels_off if s.families is None or family in s.families],
        }
        self.record.add_setup(family, setup)
        print(
            f"# {family}: built in {setup['build_s']:.1f} s, transformers' kernels chosen in "
            f"{setup['peer_setup_s']:.1f} s, warm-up {setup['warm_up_s']:.1f} s, micro-benchmarks "
            f"{setup['ceilings_s']:.1f} s" + (f"; transformers: {peer.setup}" if peer is not None else ""),
            flush=True,
        )
        if rooflines is not None:
            shares = ", ".join(f"{op} {r['of_roofline']:.2f}" for op, r in rooflines.items())
            print(f"# {family}: of the roofline (this run's matmul rate and bandwidth): {shares}", flush=True)
        beside.deadline = self.deadline

        def on_row(r: Row) -> None:
            print(format_row(r), flush=True)
            self.record.add_row(r)
            done.add((r["positions"], r["phase"]))

        try:
            for positions in lengths:

                def on_skip(phase: str, reason: str, positions: int = positions) -> None:
                    print(f"{family:>7} {positions:>17} {phase:>13}  skipped: {reason}", flush=True)
                    self.record.skip(family, positions, phase, reason)
                    done.add((positions, phase))

                measure_phases(model, engine, positions, family_args, on_row, beside, self.deadline, on_skip)
        except BudgetSpent:
            self.skip_all(family, "time budget spent", done)
        del engine, model, beside, peer
        free(device)


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "fla": package_version("flash-linear-attention", "fla-core"),
        "triton": package_version("triton"),
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["hybrid", "dense", "mla"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 131072], help="context positions")
    parser.add_argument(
        "--exact-at", nargs="*", type=int, default=[32768], help="lengths that also run whole detached and exact steps"
    )
    parser.add_argument(
        "--mla-lengths", nargs="+", type=int, default=None, help="the MLA family's lengths instead of --lengths"
    )
    parser.add_argument(
        "--mla-exact-at", nargs="*", type=int, default=None, help="the MLA family's whole steps instead of --exact-at"
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--experts", type=int, default=8, help="mla: routed experts (top-2)")
    parser.add_argument("--index-topk", type=int, default=2048, help="mla: keys each query attends to (DSA)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--decode-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the eager decode step (decode_eager rows) beside the CUDA-graph one (decode)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timings per phase (the median is reported)")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument(
        "--max-score-elements",
        type=int,
        default=1 << 27,
        help="EngineConfig.max_score_elements: DSA's indexer scores (and eager attention's) per piece",
    )
    parser.add_argument("--attention", choices=BACKEND_NAMES, default="auto", help="EngineConfig.attention")
    parser.add_argument(
        "--peers", action=argparse.BooleanOptionalAction, default=True, help="time transformers beside each phase"
    )
    parser.add_argument(
        "--gpu-tests", type=Path, default=None, help="pytest's JUnit XML of pytest -m gpu: failed kernels are not timed"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no phase after this many seconds (the rest are skipped)"
    )
    parser.add_argument(
        "--until", type=float, default=None, help="start no phase after this time (seconds since the epoch)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the smoke test of this script")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    parser.add_argument("--table", type=Path, default=None, help="instead: print this record as README's table")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.exact_at, args.chunk, args.hidden, args.layers, args.vocab = (
            [128, 256],
            [128],
            64,
            64,
            4,
            1024,
        )
        args.group, args.completion, args.decode_tokens, args.index_topk = 2, 8, 4, 32
        args.mla_lengths = args.mla_exact_at = None  # (the toy sizes for every family)
    for name in ("lengths", "exact_at", "mla_lengths", "mla_exact_at"):
        if any(n < 1 for n in getattr(args, name) or []):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype")
    if args.gpu_tests is not None and not args.gpu_tests.is_file():
        args.gpu_tests_missing, args.gpu_tests = str(args.gpu_tests), None  # (pytest wrote no record)
    return args


def kernel_switches(args: argparse.Namespace) -> tuple[dict[str, Any] | None, tuple[KernelSwitch, ...]]:
    """The GPU tests' verdict per kernel (None without a record) and the kernels switched off; ``args.attention``
    and the environment set accordingly (``bench/gpu.sh`` exports the environment before Python starts, as a module
    may read it at import; here it is only checked, and set if missing)."""
    if args.gpu_tests is None:
        return None, ()
    results = read_junit(args.gpu_tests)
    off = tuple(switched_off(results))
    args.attention = attention_backend(off, BACKEND_NAMES, args.attention)
    for switch in off:
        for name, value in switch.env.items():
            if os.environ.get(name) != value:
                print(f"warning: {name}={value} set now, not before Python started (bench/gpu.sh sets it first)")
                os.environ[name] = value
    failed = [r.id for r in results if r.outcome == "failed"]
    counts = {o: sum(r.outcome == o for r in results) for o in ("passed", "failed", "skipped")}
    return {"kernels": verdicts(results), "all": {**counts, "failed_tests": failed}}, off


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print and write the record row by row (also returned)."""
    args = parse_args(argv)
    if args.table is not None:
        record = json.loads(args.table.read_text())
        print(markdown(record))
        return record
    deadline = Deadline.after(args.budget_s)
    if args.until is not None:
        deadline = Deadline(min(args.until, deadline.end or args.until))
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kernel_tests, off = kernel_switches(args)
    if kernel_tests is None and getattr(args, "gpu_tests_missing", None):
        kernel_tests = {"missing": f"no record of the GPU tests at {args.gpu_tests_missing}"}
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "gpu_tests", "gpu_tests_missing")}
    record = Record(args.out, {
        "device": name, "date": now(), "args": settings, "versions": versions(), "gpu_tests": kernel_tests,
        "kernels_off": [s.kernel for s in off], "attention": args.attention,
    })  # fmt: skip
    print(f"{name}; {args.layers} layers, hidden {args.hidden}, {args.dtype}; chunk {args.chunk}")
    print(f"G={args.group} completions of {args.completion}; {args.decode_tokens} decode steps; {versions()}")
    if off:
        print(f"GPU tests failed: not timed {[s.kernel for s in off]}; attention backend {args.attention}")
    start = time.perf_counter()
    shared = SharedRates.measure(args, device)
    record.data |= {"matmul_flops_per_s": shared.matmul, "shared_rates": shared.as_dict()}
    record.write()
    print(
        f"{args.dtype} matmul ({args.chunk} x {args.hidden} x {3 * args.hidden}): {shared.matmul / 1e12:.3g} TFLOP/s. "
        "HF s: transformers' time for the same work; eng/HF: engine / transformers; of mm: the row's FLOP/s / that "
        "matmul rate; pred/meas: the time model's seconds / measured"
    )
    print("(* a difference of two phases, not a measurement)")
    print(HEADER, flush=True)
    run = Run(args, device, name, record, deadline, off, shared)
    for family in args.families:
        run.family(family)
    done = record.finish()
    print(summary(done))
    if done["skipped"]:
        print(f"skipped {len(done['skipped'])} rows: " + "; ".join(sorted({s["reason"] for s in done["skipped"]})))
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s in all)")
    return done


if __name__ == "__main__":
    main()
