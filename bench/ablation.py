"""Detached vs exact prefix gradients: how much of the true GRPO gradient the seed's detached mode keeps as the
shared prompt grows. Prints, per prompt length, the cosine and the relative L2 distance between the detached and
the exact gradient (exact equals the full-graph gradient; see tests/test_grpo.py), averaged over a few groups.

    python -m bench.ablation [--lengths 16 64 256 1024] [--groups 3]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import bench_model, compare, flat_grad, synthetic_group
from longstraw_agents.engine import Engine
from longstraw_agents.trainer import grpo_backward


def gradients(engine: Engine, model, prompt_len: int, seed: int) -> dict[str, torch.Tensor]:
    prompt, completions, rewards = synthetic_group(prompt_len, 8, 32, seed=seed)
    out = {}
    for mode in ("detached", "exact"):
        model.zero_grad(set_to_none=True)
        grpo_backward(engine, prompt, completions, rewards, mode, track_memory=False)
        out[mode] = flat_grad(model).double()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--groups", type=int, default=3, help="groups averaged per length")
    parser.add_argument("--family", default="llama", choices=["llama", "qwen3", "qwen3_5", "glm_moe_dsa"])
    args = parser.parse_args()
    model = bench_model(args.family)
    engine = Engine(model, chunk_size=256)
    print(f"{args.family}, G=8, completions 32 tokens, {args.groups} groups per length")
    print(f"{'prompt':>8} {'cosine(detached, exact)':>24} {'|det - exact| / |exact|':>24}")
    for length in args.lengths:
        cosines, distances = [], []
        for seed in range(args.groups):
            g = gradients(engine, model, length, seed)
            compared = compare(g["detached"], g["exact"])
            if compared is not None:  # a random-init policy's gradient vanishes only if every reward is equal
                cosines.append(compared[0])
                distances.append(compared[1])
        if not cosines:
            print(f"{length:>8} {'(the exact gradient vanished in every group)':>49}")
            continue
        fewer = f"  (mean of {len(cosines)}: the others' gradient vanished)" if len(cosines) < args.groups else ""
        print(f"{length:>8} {sum(cosines) / len(cosines):>24.3f} {sum(distances) / len(distances):>24.3f}{fewer}")


if __name__ == "__main__":
    main()
