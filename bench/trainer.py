"""Trainer benchmark, one run, ratios side by side (CPU, tiny Llama-layout model, fp32):

1. peak tracked memory vs group size G = 2..16 per mode (targets: exact, detached <= 2 % growth; naive linear);
2. peak vs prompt length and the longest prompt within a fixed memory budget per mode (target: >= 50x naive);
3. step time at G = 8: naive, detached, exact and a PrefixGrouper-style baseline (shared prefix once with a full
   graph) — targets detached <= 0.25x naive, exact <= 0.5x naive, exact <= 1.0x PrefixGrouper.

Peak memory is what ``longstraw_agents.memory.MemoryTracker`` sees during one ``grpo_backward`` call (parameter
gradients are allocated beforehand, so they are not counted: they are the same in every mode). Writes
``bench/results/trainer.json`` and ``bench/results/trainer_memory.png``.

    python -m bench.trainer [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import (
    bench_model,
    flat_grad,
    materialise_grads,
    prefix_grouper_backward,
    synthetic_group,
)
from longstraw_agents.engine import Engine
from longstraw_agents.trainer import grpo_backward

MODES = ("naive", "detached", "exact")
RESULTS = Path(__file__).parent / "results"


def peak_bytes(model, mode: str, prompt_len: int, group: int, completion_len: int, chunk: int) -> int:
    prompt, completions, rewards = synthetic_group(prompt_len, group, completion_len)
    materialise_grads(model)
    stats = grpo_backward(model, prompt, completions, rewards, mode, chunk_size=chunk, track_memory=True)
    return int(stats.peak_bytes)


def memory_vs_group(model, prompt_len, completion_len, chunk, groups) -> dict[str, list[int]]:
    return {m: [peak_bytes(model, m, prompt_len, g, completion_len, chunk) for g in groups] for m in MODES}


def memory_vs_prompt(model, lengths, group, completion_len, chunk, modes=MODES) -> dict[str, list[int]]:
    return {m: [peak_bytes(model, m, p, group, completion_len, chunk) for p in lengths] for m in modes}


def longest_within(lengths: list[int], peaks: list[int], budget: int) -> tuple[float, bool]:
    """Longest prompt whose peak fits ``budget``: interpolated between measured points; beyond the last measured
    length, extrapolated with a straight-line fit of the measured peaks (returns (length, extrapolated))."""
    lengths_a, peaks_a = np.asarray(lengths, float), np.asarray(peaks, float)
    if peaks_a[-1] >= budget:
        return float(np.interp(budget, peaks_a, lengths_a)), False
    slope, intercept = np.polyfit(lengths_a, peaks_a, 1)
    return float((budget - intercept) / slope), True


def step_times(model, prompt_len, group, completion_len, chunk, repeats) -> dict[str, float]:
    """Median seconds per step of each mode and of the PrefixGrouper baseline, timed round-robin (one step of each
    per round) so that a slow spell of the machine hits all of them alike."""
    prompt, completions, rewards = synthetic_group(prompt_len, group, completion_len)
    engine = Engine(model, chunk_size=chunk)
    runs = {mode: functools.partial(grpo_backward, engine, prompt, completions, rewards, mode, track_memory=False)
            for mode in MODES}  # fmt: skip
    runs["prefix_grouper"] = functools.partial(prefix_grouper_backward, engine, prompt, completions, rewards)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    grads = {}
    for _ in range(repeats):
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
            grads[name] = flat_grad(model)
    times = {name: statistics.median(values) for name, values in samples.items()}
    naive = grads["naive"]
    check = float((grads["prefix_grouper"] - naive).norm() / naive.norm())
    exact_check = float((grads["exact"] - naive).norm() / naive.norm())
    return {**times, "prefix_grouper_vs_naive_grad_rel": check, "exact_vs_naive_grad_rel": exact_check}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_g, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    groups = results["groups"]
    for mode, peaks in results["memory_vs_group"].items():
        ax_g.plot(groups, np.asarray(peaks) / 2**20, marker="o", label=mode)
    ax_g.set(xlabel="group size G", ylabel="peak tracked MiB", title=f"prompt {results['prompt_len']} tokens")
    for mode, peaks in results["memory_vs_prompt"].items():
        lengths = results["prompt_lengths"][mode]
        ax_p.plot(lengths, np.asarray(peaks) / 2**20, marker="o", label=mode)
    ax_p.axhline(results["budget"] / 2**20, color="grey", linestyle="--", label="budget")
    ax_p.set(xlabel="prompt tokens", ylabel="peak tracked MiB", xscale="log", yscale="log", title="G = 8")
    for ax in (ax_g, ax_p):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = bench_model()
    chunk, completion_len = 256, 32
    prompt_len = 256 if args.quick else 1024
    groups = [2, 4, 8, 16]
    naive_lengths = [64, 128, 256] if args.quick else [128, 256, 512, 1024]
    long_lengths = [256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192]
    budget_prompt = 128 if args.quick else 256

    print(f"model: llama layout, hidden 128, 2 layers, {sum(p.numel() for p in model.parameters()):,} params, fp32")
    print(f"\n1) peak tracked memory vs G (prompt {prompt_len}, completions {completion_len}, chunk {chunk})")
    by_group = memory_vs_group(model, prompt_len, completion_len, chunk, groups)
    print(f"{'mode':<10}" + "".join(f"{'G=' + str(g):>10}" for g in groups) + f"{'G16/G2':>9}")
    for mode, peaks in by_group.items():
        row = "".join(f"{p / 2**20:>9.1f}M" for p in peaks)
        print(f"{mode:<10}{row}{peaks[-1] / peaks[0]:>9.3f}")

    print(f"\n2) peak vs prompt length (G=8) and the longest prompt within naive's peak at {budget_prompt} tokens")
    by_prompt = memory_vs_prompt(model, naive_lengths, 8, completion_len, chunk, ("naive",))
    by_prompt.update(memory_vs_prompt(model, long_lengths, 8, completion_len, chunk, ("detached", "exact")))
    lengths = {"naive": naive_lengths, "detached": long_lengths, "exact": long_lengths}
    budget = by_prompt["naive"][naive_lengths.index(budget_prompt)]
    longest = {m: longest_within(lengths[m], by_prompt[m], budget) for m in MODES}
    verified: dict[str, dict] = {}
    for mode in MODES:
        points = ", ".join(f"{n}: {p / 2**20:.1f}M" for n, p in zip(lengths[mode], by_prompt[mode], strict=True))
        value, extrapolated = longest[mode]
        note = " (linear fit beyond the measured lengths)" if extrapolated else ""
        ratio = value / longest["naive"][0]
        print(f"{mode:<10} {points}")
        print(f"{'':<10} longest within {budget / 2**20:.1f}M: {value:,.0f} tokens = {ratio:.0f}x naive{note}")
        if extrapolated:  # check the fit: measure at the predicted length
            check = peak_bytes(model, mode, int(value), 8, completion_len, chunk)
            verified[mode] = {"prompt": int(value), "peak": check, "fits": check <= budget}
            verdict = "fits" if check <= budget else "over"
            print(f"{'':<10} measured at {int(value):,} tokens: {check / 2**20:.1f}M ({verdict})")

    print("\n3) step time at G=8 (grpo_backward, no memory tracking; median of 5 rounds, modes timed round-robin)")
    times = step_times(model, prompt_len, 8, completion_len, chunk, repeats=1 if args.quick else 5)
    for name in ("naive", "detached", "exact", "prefix_grouper"):
        print(f"{name:<15} {times[name] * 1e3:>8.0f} ms  {times[name] / times['naive']:>6.2f}x naive")
    print(f"exact / prefix_grouper: {times['exact'] / times['prefix_grouper']:.2f}x")
    print(
        f"gradient checks: exact vs naive {times['exact_vs_naive_grad_rel']:.1e}, "
        f"prefix_grouper vs naive {times['prefix_grouper_vs_naive_grad_rel']:.1e} (relative L2)"
    )

    RESULTS.mkdir(exist_ok=True)
    results = {
        "prompt_len": prompt_len,
        "groups": groups,
        "memory_vs_group": by_group,
        "prompt_lengths": lengths,
        "memory_vs_prompt": by_prompt,
        "budget": budget,
        "longest_within_budget": {m: v for m, (v, _) in longest.items()},
        "longest_verified": verified,
        "step_seconds": times,
    }
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"trainer{suffix}.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / f"trainer_memory{suffix}.png")
    print(f"\nwrote {RESULTS / f'trainer{suffix}.json'} and trainer_memory{suffix}.png")


if __name__ == "__main__":
    main()
