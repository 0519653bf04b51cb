"""Capture reuse across the μ optimizer steps of one update (detached mode, ``GRPOConfig.capture_reuse``): how far the
loss and the gradient drift from recapturing the prefix with the current weights, and how much time it saves.

One group (a long shared prompt, G completions with behaviour log-probs from the starting weights), μ AdamW steps
on it. At each step k both variants are evaluated at the same weights θ_k: *reuse* replays the completions on the
prompt's state captured at θ_0, *recapture* captures the prompt again at θ_k; the update then applies the reuse
gradient, as the trainer does. Step 0 is identical by construction (reuse captures there). For scale, the last
column is the detached gradient's own distance from the exact one (what detached mode drops at every step).

    python -m bench.capture_reuse [--prompt 2048] [--group 8] [--completion 64] [--mu 4] [--lr 1e-5]
                                  [--out bench/results/capture_reuse.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import bench_model, flat_grad, synthetic_group
from longstraw_agents.engine import Engine
from longstraw_agents.trainer import LossConfig, backward_group, make_group
from longstraw_agents.trainer.group import completion_members, token_array
from longstraw_agents.trainer.modes import PrefixCache


def behaviour_logprobs(engine: Engine, prompt: torch.Tensor, completions: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a sampler with the starting weights records: each completion's log-probs (no graph)."""
    out = []
    with torch.no_grad():
        for completion in completions:
            ids = torch.cat([prompt, completion])
            logits = engine.logits(engine.empty_state(), ids[:-1])[len(prompt) - 1 :].double()
            out.append(torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0])
    return out


def timed_gradient(engine: Engine, group, mode: str, config: LossConfig, cache: PrefixCache | None):
    engine.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    result = backward_group(engine, group, mode, config, track_memory=False, prefix_cache=cache)
    return result.loss, flat_grad(engine.model).double(), time.perf_counter() - start


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|; 0 when both vanish (a large lr can clip every ratio: then no gradient is left to compare)."""
    if b.norm() == 0:
        return 0.0 if a.norm() == 0 else float("inf")
    return float((a - b).norm() / b.norm())


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    model = bench_model(args.family, hidden=args.hidden, layers=args.layers)
    engine = Engine(model, chunk_size=args.chunk)
    prompt, completions, rewards = synthetic_group(args.prompt, args.group, args.completion)
    config = LossConfig()
    old = behaviour_logprobs(engine, prompt, completions)
    group = make_group(completion_members(token_array(prompt, "prompt"), completions, old), rewards, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cache = PrefixCache()
    rows = []
    for step in range(args.mu):
        fresh_loss, fresh, fresh_s = timed_gradient(engine, group, "detached", config, None)
        _, exact, _ = timed_gradient(engine, group, "exact", config, None)
        reuse_loss, reuse, reuse_s = timed_gradient(engine, group, "detached", config, cache)
        rows.append(
            {
                "step": step,
                "loss_reuse": reuse_loss,
                "loss_recapture": fresh_loss,
                "loss_drift": abs(reuse_loss - fresh_loss),
                "grad_drift": relative(reuse, fresh),
                "cosine": float(torch.nn.functional.cosine_similarity(reuse, fresh, dim=0)),
                "detached_vs_exact": relative(fresh, exact),
                "seconds_reuse": reuse_s,
                "seconds_recapture": fresh_s,
            }
        )
        optimizer.step()  # p.grad holds the reuse gradient (computed last), as in the trainer
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--mu", type=int, default=4, help="optimizer steps on the same group (num_iterations)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--family", default="llama", choices=["llama", "qwen3", "qwen3_5", "glm_moe_dsa"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the rows and the setting as JSON here")
    args = parser.parse_args()
    rows = run(args)
    print(
        f"{args.family} hidden {args.hidden} x {args.layers} layers, prompt {args.prompt}, G={args.group}, "
        f"completions {args.completion}, AdamW lr {args.lr}, {args.threads} threads"
    )
    header = ("step", "loss drift", "grad drift", "cosine", "reuse s", "recapture s", "speedup", "det vs exact")
    print(" ".join(f"{h:>12}" for h in header))
    for r in rows:
        speedup = r["seconds_recapture"] / r["seconds_reuse"]
        cells = (r["step"], r["loss_drift"], r["grad_drift"], r["cosine"], r["seconds_reuse"], r["seconds_recapture"])
        print(
            f"{cells[0]:>12} {cells[1]:>12.2e} {cells[2]:>12.2e} {cells[3]:>12.6f} {cells[4]:>12.3f} {cells[5]:>12.3f}"
            f" {speedup:>11.2f}x {r['detached_vs_exact']:>12.3f}"
        )
    later = rows[1:]
    if later:
        saved = sum(r["seconds_recapture"] - r["seconds_reuse"] for r in later)
        total = sum(r["seconds_recapture"] for r in rows)
        print(f"steps 1..{args.mu - 1}: {saved:.3f} s saved of {total:.3f} s recapturing every step")
    if args.out is not None:
        setting = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"setting": setting, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
