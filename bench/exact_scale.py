"""Exact mode at scale: the peak per prompt token, a long loss node's log-probabilities and the time/memory trade of
kept graphs, measured.

1. **Hybrid exact mode's peak per prompt token** at the default recurrent-checkpoint spacing, against the attention
   state plus the amortised checkpoints per token (target <= 2.5x); checkpoint bytes reported separately.
2. **A long loss node**: 16K tokens on a vocabulary of 100K: the peak of the tiled log-probabilities (forward and
   backward) against one [n, V] fp32 tensor (target <= 1/16), and the gradient against the untiled one (fp64, at a
   reduced length that the untiled reference fits in memory).
3. **The memory-budget curve**: exact step time as ``EngineConfig.graph_budget_bytes`` grows from 0 (recompute every
   chunk) to the real PrefixGrouper's peak and beyond, with PrefixGrouper's own time and peak beside it (the
   trainer benchmark's setting: the tiny Llama, prompt 8,192, G = 16 completions of 16).

    python -m bench.exact_scale [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import materialise_grads, synthetic_group
from bench.peers import prefix_grouper_backward
from bench.trainer import measurement_config
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.logprobs import head_logprobs
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import build_model, tiny_qwen3_5
from longstraw_agents.trainer import grpo_backward

RESULTS = Path(__file__).parent / "results"
MIB = 2**20


def hybrid_growth(lengths: list[int], chunk: int) -> dict:
    """Exact peaks of the tiny hybrid (G = 2) at two prompt lengths; growth per token vs state + checkpoints."""
    model = build_model(tiny_qwen3_5(vocab_size=2048), dtype=torch.float32)
    engine = Engine(model, EngineConfig(chunk_size=chunk))
    size = state_size(model.config, torch.float32)
    peaks, checkpoints = [], []
    for length in lengths:
        prompt, completions, rewards = synthetic_group(length, 2, 16)
        materialise_grads(model)
        peaks.append(grpo_backward(engine, prompt, completions, rewards, "exact", track_memory=True).peak_bytes)
        checkpoints.append(engine.capture(prompt, checkpoints=True).checkpoint_nbytes)
    tokens = lengths[-1] - lengths[0]
    growth = (peaks[-1] - peaks[0]) / tokens
    checkpoint_per_token = (checkpoints[-1] - checkpoints[0]) / tokens
    per_token = size.bytes_per_token + checkpoint_per_token
    return {
        "lengths": lengths,
        "spacing": engine.checkpoint_spacing,
        "peak_bytes": peaks,
        "checkpoint_bytes": checkpoints,
        "attention_bytes_per_token": size.bytes_per_token,
        "checkpoint_bytes_per_token": checkpoint_per_token,
        "growth_bytes_per_token": growth,
        "ratio": growth / per_token,
    }


def long_loss_node(tokens: int, vocab: int, width: int, check_tokens: int) -> dict:
    """Peak of tiled log-probs over ``tokens`` x ``vocab`` vs one [n, V] fp32 tensor; gradient vs untiled."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=gen) * width**-0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    start = time.perf_counter()
    with MemoryTracker() as tracker:
        head_logprobs(hidden, weight, targets).sum().backward()
    seconds = time.perf_counter() - start
    weight_grad = weight.numel() * 4  # what autograd hands the parameter in any case
    h64, w64 = hidden[:check_tokens].detach().double(), weight.detach().double()
    h64.requires_grad_(True)
    w64.requires_grad_(True)
    tiled = torch.autograd.grad(head_logprobs(h64, w64, targets[:check_tokens]).sum(), (h64, w64))
    full = torch.log_softmax(h64 @ w64.T, -1).gather(-1, targets[:check_tokens, None])[:, 0]
    untiled = torch.autograd.grad(full.sum(), (h64, w64))
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(tiled, untiled, strict=True))
    full_bytes = tokens * vocab * 4
    return {
        "tokens": tokens,
        "vocab": vocab,
        "seconds": seconds,
        "peak_bytes": tracker.peak_bytes,
        "peak_without_weight_grad": tracker.peak_bytes - weight_grad,
        "full_logits_bytes": full_bytes,
        "ratio": (tracker.peak_bytes - weight_grad) / full_bytes,
        "gradient_relative_error_fp64": error,
        "checked_tokens": check_tokens,
    }


def budget_curve(prompt_len: int, group: int, completion: int, chunk: int, fractions: list[float]) -> dict:
    """Exact step time and peak for graph budgets at fractions of PrefixGrouper's peak, PrefixGrouper beside."""
    model = build_model(measurement_config(), dtype=torch.float32)
    prompt, completions, rewards = synthetic_group(prompt_len, group, completion)
    materialise_grads(model)
    with MemoryTracker() as tracker:
        prefix_grouper_backward(model, prompt, completions, rewards)
    pg_peak = tracker.peak_bytes
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    prefix_grouper_backward(model, prompt, completions, rewards)
    pg_seconds = time.perf_counter() - start
    rows = []
    for fraction in fractions:
        engine = Engine(model, EngineConfig(chunk_size=chunk, graph_budget_bytes=int(fraction * pg_peak)))
        materialise_grads(model)
        peak = grpo_backward(engine, prompt, completions, rewards, "exact", track_memory=True).peak_bytes
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        grpo_backward(engine, prompt, completions, rewards, "exact", track_memory=False)
        rows.append({"fraction": fraction, "seconds": time.perf_counter() - start, "peak_bytes": peak})
    return {"prefix_grouper": {"seconds": pg_seconds, "peak_bytes": pg_peak}, "exact": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes (the smoke test)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "exact_scale.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quick = args.quick
    growth = hybrid_growth([512, 1024] if quick else [2048, 8192], 128 if quick else 512)
    print(
        f"1. tiny hybrid, exact mode, default checkpoint spacing k={growth['spacing']}: peak grows "
        f"{growth['growth_bytes_per_token']:.0f} B per prompt token; attention state "
        f"{growth['attention_bytes_per_token']} B/token + checkpoints "
        f"{growth['checkpoint_bytes_per_token']:.0f} B/token (held: "
        f"{growth['checkpoint_bytes'][-1] / MIB:.2f} MiB at {growth['lengths'][-1]} tokens) -> "
        f"{growth['ratio']:.2f}x [target <= 2.5]"
    )
    node = long_loss_node(2048 if quick else 16384, 8192 if quick else 100_000, 64, 256 if quick else 2048)
    print(
        f"2. a loss node of {node['tokens']} tokens over a vocabulary of {node['vocab']}: peak "
        f"{node['peak_bytes'] / MIB:.1f} MiB ({node['peak_without_weight_grad'] / MIB:.1f} MiB besides the weight's "
        f"gradient) vs {node['full_logits_bytes'] / MIB:.0f} MiB for [n, V] fp32 logits -> {node['ratio']:.4f} "
        f"[target <= 1/16]; gradient vs untiled (fp64, {node['checked_tokens']} tokens) "
        f"{node['gradient_relative_error_fp64']:.1e}; {node['seconds']:.1f} s forward + backward"
    )
    sizes = (256, 4, 8, 64) if quick else (8192, 16, 16, 512)
    curve = budget_curve(*sizes, [0.0, 0.125, 0.25, 0.5, 1.0, 2.0])
    pg = curve["prefix_grouper"]
    print(f"3. exact step vs graph budget (prompt {sizes[0]}, G={sizes[1]}); PrefixGrouper {pg['seconds']:.2f} s, "
          f"peak {pg['peak_bytes'] / MIB:.1f} MiB")  # fmt: skip
    print(f"{'budget / PG peak':>17} {'exact s':>8} {'/ PG time':>10} {'peak MiB':>9} {'/ PG peak':>10}")
    for row in curve["exact"]:
        print(
            f"{row['fraction']:>17.3f} {row['seconds']:>8.2f} {row['seconds'] / pg['seconds']:>9.2f}x "
            f"{row['peak_bytes'] / MIB:>9.1f} {row['peak_bytes'] / pg['peak_bytes']:>9.3f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {"hybrid_growth": growth, "long_loss_node": node, "budget_curve": curve, "quick": quick}
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
