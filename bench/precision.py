"""Gradient precision of a bf16 model at a long prompt, against the same weights in fp64.

The exact gradient of an early prefix chunk's K/V is a sum over every later position; accumulated in bf16 (the
state's dtype) most of it rounds away. The engine accumulates the state gradient in fp32 by default
(``EngineConfig.grad_accumulation``). This prints cosine similarity and relative L2 error of the bf16 parameter
gradient against the fp64 exact gradient for: detached mode (no prefix gradient at all), exact mode with bf16 state-
gradient buffers, exact mode with fp32 buffers.

    python -m bench.precision [--prompt 4096] [--chunk 64] [--group 4]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.trainer import grpo_backward

RESULTS = Path(__file__).parent / "results"
VOCAB = 512


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])


def gradient(model, prompt, completions, rewards, mode: str, chunk: int, accumulation: str = "fp32"):
    model.zero_grad(set_to_none=True)
    engine = Engine(model, EngineConfig(chunk_size=chunk, grad_accumulation=accumulation))
    grpo_backward(engine, prompt, completions, rewards, mode, track_memory=False)
    return flat_grad(model)


def precision_table(family: str, prompt_len: int, chunk: int, group: int, completion: int) -> dict[str, dict]:
    """Cosine and relative L2 of each bf16 variant's gradient against the fp64 exact gradient."""
    reference = build_model(TINY_PRESETS[family](vocab_size=VOCAB), dtype=torch.float64)
    bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    completions = [torch.randint(0, VOCAB, (completion,), generator=gen) for _ in range(group)]
    rewards = torch.rand(group, generator=gen).tolist()
    truth = gradient(reference, prompt, completions, rewards, "exact", chunk)
    variants = {
        "detached": ("detached", "fp32"),
        "exact, bf16 state-gradient buffers": ("exact", "state"),
        "exact, fp32 state-gradient buffers": ("exact", "fp32"),
    }
    table = {}
    for name, (mode, accumulation) in variants.items():
        g = gradient(bf16, prompt, completions, rewards, mode, chunk, accumulation)
        cosine = float(torch.nn.functional.cosine_similarity(g, truth, dim=0))
        table[name] = {"cosine": cosine, "relative_l2": float((g - truth).norm() / truth.norm())}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "precision.json")
    args = parser.parse_args()
    table = precision_table(args.family, args.prompt, args.chunk, args.group, args.completion)
    print(
        f"{args.family} bf16 vs fp64 exact gradient: prompt {args.prompt} in chunks of {args.chunk}, "
        f"G={args.group} completions of {args.completion}"
    )
    print(f"{'variant':<38} {'cosine':>10} {'rel. L2':>10}")
    for name, row in table.items():
        print(f"{name:<38} {row['cosine']:>10.7f} {row['relative_l2']:>10.6f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"args": settings, "results": table}, indent=1))


if __name__ == "__main__":
    main()
