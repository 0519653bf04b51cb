"""Trainer benchmark: this project's GRPO modes against the real peers, one run, ratios side by side (CPU, fp32).

Contenders, all on one transformers ``LlamaForCausalLM`` (the same weights) and one GRPO loss (on-policy, TRL's
"dapo" / token-mean aggregation for one group, advantages ``(r - mean) / (std + 1e-4)``):

- this project's modes through ``longstraw_agents.trainer.grpo_backward``: ``naive`` (one graph per member through
  the engine), ``detached`` (the prefix gradient dropped) and ``exact``;
- ``prefix_grouper``: the real PrefixGrouper (``prefix-grouper`` on PyPI, the ``bench`` extra) through its own
  transformers attention hook on transformers' SDPA (``bench/peers.py`` says how it is wired, and why its hook needs
  a few lines of mask adapter to run on SDPA correctly), ``split_output`` over the final hidden states and the LM
  head on the completions only — the leaner way to use it and the baseline of every "/ PG" ratio;
  ``prefix_grouper_logits``: the same with its README's snippet as written (``split_output`` over the logits of
  every position);
- ``per_member_sdpa``: a conventional trainer's step — the G sequences prompt + completion through ``model(...)``
  with transformers' SDPA attention, one backward.

The measurement model: Llama layout, hidden 64, 2 layers, 8 heads / 2 KV heads (head_dim 8),
vocab 2048.

1. The setting, prompt 8,192, G = 16, completions of 16: gradient of each contender against exact mode's
   (relative L2), step time (median of a few rounds, contenders timed round-robin so that a slow spell of the machine
   hits all alike; the per-member graph, ~15x slower, in the first round only) and peak memory. Targets: exact
   <= 1.4x PrefixGrouper's time, detached <= 0.6x, both <= 0.25x its peak.
2. Peak vs prompt length at G = 2 (2K, 8K, 16K): exact mode's peak growth per prompt token (least-squares slope)
   over the analytic state bytes per token (target <= 2.5); exact / per_member_sdpa at 2,048 (target <= 0.5); the
   longest prompt each contender fits within per_member_sdpa's peak at 8,192 tokens.
3. Peak vs group size G = 2..16 at prompt 1,024.

Peak memory is what ``longstraw_agents.memory.MemoryTracker`` (a ``TorchDispatchMode`` over op outputs) sees during
one step, parameter gradients allocated beforehand (they are the same for everyone): inside ``grpo_backward`` for
this project's modes, around the whole peer function for the peers. The bench counts the fused SDPA kernel calls the
tracker saw in the peers' steps, to show their outputs are counted. Not seen by any dispatch mode, for everyone
alike: a kernel's internal scratch buffers (the CPU flash kernels' per-thread blocks) and allocator overhead.

Writes ``trainer.json`` and ``trainer_memory.png`` (``_quick`` with ``--quick``) to ``bench/results`` or ``--out``.

    python -m bench.trainer [--quick] [--out DIR] [--threads N] [--chunk N]

``--threads 1`` when other jobs share the cores: two torch threads on two busy cores spin-wait in every parallel
region, which slowed tiny steps here 50-100x and made timings meaningless.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from bench.common import VOCAB, flat_grad, materialise_grads, synthetic_group
from bench.peers import per_member_sdpa_backward, prefix_grouper_backward
from longstraw_agents.engine import Engine
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import build_model
from longstraw_agents.trainer import grpo_backward

MODES = ("naive", "detached", "exact")
PEERS: dict[str, Callable[..., float]] = {
    "prefix_grouper": functools.partial(prefix_grouper_backward, split="hidden"),  # the baseline of the ratios
    "prefix_grouper_logits": functools.partial(prefix_grouper_backward, split="logits"),  # its README's snippet
    "per_member_sdpa": per_member_sdpa_backward,
}
CONTENDERS = (*MODES, *PEERS)
TIMED = ("exact", "detached", *PEERS)
TIMED_ONCE = ("per_member_sdpa",)  # ~15x PrefixGrouper's step in the setting: one sample, not a median
RESULTS = Path(__file__).parent / "results"
SDPA_KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"
TARGETS = {  # (what, limit); every figure is a ratio that must stay at or below its limit
    "exact_time_vs_pg": ("exact step time / PrefixGrouper's", 1.4),
    "detached_time_vs_pg": ("detached step time / PrefixGrouper's", 0.6),
    "exact_peak_vs_pg": ("exact peak / PrefixGrouper's", 0.25),
    "detached_peak_vs_pg": ("detached peak / PrefixGrouper's", 0.25),
    "exact_growth_vs_state": ("exact peak growth per prompt token / state bytes per token", 2.5),
    "exact_vs_sdpa_short": ("exact peak / per-member SDPA graph's at the shortest prompt", 0.5),
}
MIB = 2**20
NAME = 23  # width of the contender column


@dataclass(frozen=True)
class Sizes:
    """Every size of one run (full or ``--quick``)."""

    prompt: int  # section 1
    group: int
    completion: int
    rounds: int
    lengths: tuple[int, ...]  # section 2, at G = 2
    budget_prompt: int  # per_member_sdpa's peak at this prompt length is the budget
    group_prompt: int  # section 3
    groups: tuple[int, ...]


FULL = Sizes(8192, 16, 16, 3, (2048, 8192, 16384), 8192, 1024, (2, 4, 8, 16))
QUICK = Sizes(128, 4, 4, 1, (64, 128, 256), 128, 64, (2, 4))


def measurement_config() -> LlamaConfig:
    """Issue 12's measurement model (random-init, fp32; eager attention for the engine, the peers switch to SDPA)."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
    )


class KernelCountingTracker(MemoryTracker):
    """``MemoryTracker`` that also counts the fused SDPA kernel calls it saw (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel_calls = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(SDPA_KERNEL):
            self.kernel_calls["backward" if "_backward" in name else "forward"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def measure_peak(engine: Engine, model: torch.nn.Module, name: str, group) -> tuple[int, dict[str, int] | None]:
    """Peak tracked bytes of one step of ``name`` on ``group`` (and, for a peer, the SDPA kernel calls seen)."""
    prompt, completions, rewards = group
    materialise_grads(model)
    if name in MODES:
        result = grpo_backward(engine, prompt, completions, rewards, name, track_memory=True)
        return int(result.peak_bytes), None
    with KernelCountingTracker() as tracker:
        PEERS[name](model, prompt, completions, rewards)
    return tracker.peak_bytes, dict(tracker.kernel_calls)


def runners(engine: Engine, model: torch.nn.Module, group) -> dict[str, Callable[[], object]]:
    prompt, completions, rewards = group
    runs: dict[str, Callable[[], object]] = {
        mode: functools.partial(grpo_backward, engine, prompt, completions, rewards, mode, track_memory=False)
        for mode in MODES
    }
    runs.update({name: functools.partial(peer, model, prompt, completions, rewards) for name, peer in PEERS.items()})
    return runs


def step_times(
    engine: Engine, model: torch.nn.Module, group, rounds: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per step of each timed contender over ``rounds`` rounds (one step of each per round, round-robin,
    after a warm-up on a tiny group; the slow per-member graph in the first round only), and each one's gradient
    against exact mode's (relative L2)."""
    for run in runners(engine, model, synthetic_group(32, 2, 4, seed=1)).values():
        model.zero_grad(set_to_none=True)
        run()
    runs = {name: run for name, run in runners(engine, model, group).items() if name in TIMED}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    grads: dict[str, torch.Tensor] = {}
    for round_ in range(rounds):
        for name, run in runs.items():
            if round_ and name in TIMED_ONCE:
                continue
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
            grads[name] = flat_grad(model).double()
    exact = grads["exact"]
    rel = {name: float((g - exact).norm() / exact.norm()) for name, g in grads.items() if name != "exact"}
    return samples, rel


def longest_within(lengths, peaks, budget: float) -> tuple[float, bool]:
    """Longest prompt whose peak fits ``budget``: interpolated between measured points when the budget lies in their
    range, else from a straight-line fit of the measured peaks (returns (length, extrapolated))."""
    lengths_a, peaks_a = np.asarray(lengths, float), np.asarray(peaks, float)
    if peaks_a[0] <= budget <= peaks_a[-1] and np.all(np.diff(peaks_a) > 0):
        return float(np.interp(budget, peaks_a, lengths_a)), False
    slope, intercept = np.polyfit(lengths_a, peaks_a, 1)
    return max(0.0, float((budget - intercept) / slope)), True


def target_report(values: dict[str, float]) -> dict[str, dict]:
    return {
        key: {"what": what, "value": values[key], "target": limit, "met": values[key] <= limit}
        for key, (what, limit) in TARGETS.items()
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_g, ax_p) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_group, by_prompt = results["memory_vs_group"], results["memory_vs_prompt"]
    for name in CONTENDERS:
        style = {"marker": "o", "label": name, "linestyle": "--" if name in PEERS else "-"}
        ax_g.plot(by_group["groups"], np.asarray(by_group["peak_bytes"][name]) / MIB, **style)
        ax_p.plot(by_prompt["lengths"], np.asarray(by_prompt["peak_bytes"][name]) / MIB, **style)
    ax_g.set(
        xlabel="group size G",
        ylabel="peak tracked MiB",
        xscale="log",
        yscale="log",
        title=f"prompt {by_group['prompt_len']} tokens",
    )
    ax_g.set_xticks(by_group["groups"], [str(g) for g in by_group["groups"]], minor=False)
    ax_g.set_xticks([], minor=True)
    budget = results["longest_within_budget"]
    ax_p.axhline(
        budget["budget_bytes"] / MIB,
        color="grey",
        linestyle=":",
        label=f"budget: per_member_sdpa at {budget['budget_prompt']}",
    )
    ax_p.set(
        xlabel="prompt tokens", ylabel="peak tracked MiB", xscale="log", yscale="log", title=f"G = {by_prompt['group']}"
    )
    ax_p.set_xticks(by_prompt["lengths"], [str(n) for n in by_prompt["lengths"]], minor=False)
    ax_p.set_xticks([], minor=True)
    for ax in (ax_g, ax_p):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("peak tracked memory of one GRPO step (tiny Llama, fp32, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def section_setting(engine: Engine, model: torch.nn.Module, sizes: Sizes) -> dict:
    group = synthetic_group(sizes.prompt, sizes.group, sizes.completion)
    print(
        f"\n1) the setting: prompt {sizes.prompt}, G={sizes.group}, completions of {sizes.completion} "
        f"(step time: median of {sizes.rounds} round(s), timed round-robin, {', '.join(TIMED_ONCE)} in the first "
        "only; no memory tracking)"
    )
    samples, grad_rel = step_times(engine, model, group, sizes.rounds)
    seconds = {name: statistics.median(values) for name, values in samples.items()}
    peaks, kernels = {}, {}
    for name in TIMED:
        peaks[name], seen = measure_peak(engine, model, name, group)
        if seen is not None:
            kernels[name] = seen
    pg_time, pg_peak = seconds["prefix_grouper"], peaks["prefix_grouper"]
    print(f"{'contender':<{NAME}}{'step s':>10}{'peak MiB':>11}{'time / PG':>11}{'peak / PG':>11}")
    for name in TIMED:
        t, p = seconds[name], peaks[name]
        print(f"{name:<{NAME}}{t:>10.3f}{p / MIB:>11.1f}{t / pg_time:>10.2f}x{p / pg_peak:>10.3f}x")
    others = ", ".join(f"{name} {grad_rel[name]:.1e}" for name in PEERS)
    print(
        f"gradient vs exact mode (relative L2): {others}; "
        f"detached {grad_rel['detached']:.1e} (drops the prefix gradient by design)"
    )
    calls = ", ".join(f"{name} {k['forward']} forward / {k['backward']} backward" for name, k in kernels.items())
    print(f"fused SDPA kernel calls ({SDPA_KERNEL}) whose outputs MemoryTracker counted: {calls}")
    unseen = [name for name, k in kernels.items() if not (k["forward"] and k["backward"])]
    if unseen:
        print(f"WARNING: the tracker saw no fused SDPA kernel in {unseen}: their peaks undercount")
    ratios = {
        "exact_time_vs_pg": seconds["exact"] / pg_time,
        "detached_time_vs_pg": seconds["detached"] / pg_time,
        "exact_peak_vs_pg": peaks["exact"] / pg_peak,
        "detached_peak_vs_pg": peaks["detached"] / pg_peak,
    }
    return {
        "prompt_len": sizes.prompt,
        "group": sizes.group,
        "completion_len": sizes.completion,
        "rounds": sizes.rounds,
        "step_seconds": seconds,
        "step_samples": samples,
        "peak_bytes": peaks,
        "ratios": ratios,
        "grad_rel_vs_exact": grad_rel,
        "sdpa_kernel_calls_tracked": kernels,
    }


def section_prompt(
    engine: Engine, model: torch.nn.Module, sizes: Sizes, state_bytes_per_token: int
) -> tuple[dict, dict]:
    lengths, group_size = list(sizes.lengths), 2
    print(f"\n2) peak tracked MiB vs prompt length (G={group_size}, completions of {sizes.completion})")
    peaks: dict[str, list[int]] = {name: [] for name in CONTENDERS}
    for length in lengths:
        group = synthetic_group(length, group_size, sizes.completion)
        for name in CONTENDERS:
            peaks[name].append(measure_peak(engine, model, name, group)[0])
    print(f"{'contender':<{NAME}}" + "".join(f"{n:>10}" for n in lengths))
    for name in CONTENDERS:
        print(f"{name:<{NAME}}" + "".join(f"{p / MIB:>10.1f}" for p in peaks[name]))
    growth = float(np.polyfit(lengths, peaks["exact"], 1)[0])
    growth_ratio = growth / state_bytes_per_token
    short = peaks["exact"][0] / peaks["per_member_sdpa"][0]
    print(
        f"exact peak growth per prompt token: {growth:.0f} B (least-squares slope over {lengths[0]}..{lengths[-1]}) "
        f"= {growth_ratio:.2f}x the state's {state_bytes_per_token} B/token"
    )
    print(f"exact / per_member_sdpa peak at prompt {lengths[0]}: {short:.3f}")
    budget = peaks["per_member_sdpa"][lengths.index(sizes.budget_prompt)]
    print(f"longest prompt within per_member_sdpa's peak at {sizes.budget_prompt} tokens ({budget / MIB:.1f} MiB):")
    longest = {}
    for name in CONTENDERS:
        tokens, extrapolated = longest_within(lengths, peaks[name], budget)
        longest[name] = {"tokens": tokens, "extrapolated": extrapolated}
        note = " (straight-line fit of the measured peaks)" if extrapolated else ""
        print(f"  {name:<{NAME}}{tokens:>12,.0f} tokens{note}")
    by_prompt = {
        "group": group_size,
        "completion_len": sizes.completion,
        "lengths": lengths,
        "peak_bytes": peaks,
        "state_bytes_per_token": state_bytes_per_token,
        "exact_growth_bytes_per_token": growth,
        "exact_growth_vs_state": growth_ratio,
        "exact_vs_sdpa_short": short,
    }
    return by_prompt, {"budget_prompt": sizes.budget_prompt, "budget_bytes": budget, "longest": longest}


def section_group(engine: Engine, model: torch.nn.Module, sizes: Sizes) -> dict:
    groups = list(sizes.groups)
    print(f"\n3) peak tracked MiB vs G (prompt {sizes.group_prompt}, completions of {sizes.completion})")
    peaks: dict[str, list[int]] = {name: [] for name in CONTENDERS}
    for g in groups:
        group = synthetic_group(sizes.group_prompt, g, sizes.completion)
        for name in CONTENDERS:
            peaks[name].append(measure_peak(engine, model, name, group)[0])
    print(f"{'contender':<{NAME}}" + "".join(f"{'G=' + str(g):>10}" for g in groups) + f"{'last/first':>12}")
    for name in CONTENDERS:
        row = "".join(f"{p / MIB:>10.1f}" for p in peaks[name])
        print(f"{name:<{NAME}}{row}{peaks[name][-1] / peaks[name][0]:>12.2f}")
    return {"prompt_len": sizes.group_prompt, "completion_len": sizes.completion, "groups": groups, "peak_bytes": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one timing round (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and the plot")
    parser.add_argument("--chunk", type=int, default=512, help="the engine's chunk size")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's; use 1 when other jobs share the cores)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    config = measurement_config()
    model = build_model(config)
    engine = Engine(model, chunk_size=args.chunk)
    state_bytes = state_size(config, torch.float32).bytes_per_token
    versions = {pkg: importlib.metadata.version(pkg) for pkg in ("torch", "transformers", "prefix-grouper")}
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Llama layout, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads (head_dim {config.head_dim}), "
        f"vocab {config.vocab_size}, {params:,} params, fp32; engine chunk {args.chunk}; "
        f"{torch.get_num_threads()} threads; " + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    setting = section_setting(engine, model, sizes)
    by_prompt, longest = section_prompt(engine, model, sizes, state_bytes)
    by_group = section_group(engine, model, sizes)

    targets = target_report(
        {
            **setting["ratios"],
            "exact_growth_vs_state": by_prompt["exact_growth_vs_state"],
            "exact_vs_sdpa_short": by_prompt["exact_vs_sdpa_short"],
        }
    )
    scope = " (quick sizes: a smoke run, not the targets' setting)" if args.quick else ""
    print(f"\ntargets (ratios at or below the target){scope}:")
    for entry in targets.values():
        verdict = "met" if entry["met"] else "NOT met"
        print(f"  {entry['what']:<62}{entry['value']:>8.3f}  (target <= {entry['target']}: {verdict})")

    results = {
        "model": {
            "layout": "llama",
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "vocab": config.vocab_size,
            "params": params,
            "dtype": "float32",
        },
        "chunk": args.chunk,
        "threads": torch.get_num_threads(),
        "versions": versions,
        "setting": setting,
        "memory_vs_prompt": by_prompt,
        "longest_within_budget": longest,
        "memory_vs_group": by_group,
        "targets": targets,
    }
    suffix = "_quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"trainer{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"trainer_memory{suffix}.png")
    print(f"\nwrote trainer{suffix}.json and trainer_memory{suffix}.png")


if __name__ == "__main__":
    main()
