"""Rollout benchmark: batched decoding against per-member decoding on the demo model, measured side by side.

Batched: ``TorchSampler.generate_batch`` through the rollout loop — one forward per generated token for every live
member of every group, each group's prompt attended once per step for all its members
(``longstraw_agents.engine.decoding``).
Per-member: the same sampler seen through the plain ``Sampler`` protocol (no ``generate_batch``), so the loop asks
member by member and each token is one ``Engine.step`` of one member (a sampler without batching). Both
draw the same tokens (every member has its own generator), so they generate the same number of tokens.

1) rollout tokens/s on the demo's task and model (LongStraw/Calculator-v0, the demo's sampling; a random-init policy,
   so every turn runs to the token limit) for G = 1, 4, 8, 16: one group, and a demo step of ``--groups`` groups.
2) time per generated token vs prompt length (synthetic prompts, one group of ``--slope-group`` members): the slope
   of each contender (least squares) and their ratio; the target is <= 1/G, since the batched path reads the shared
   prompt once per step for the whole group.

Timings alternate between the contenders round by round (a slow spell of a shared machine hits both alike); the
median of ``--repeats`` rounds is reported. Results go to ``bench/results/rollout.json`` (``--out``).

    python -m bench.rollout [--quick] [--threads 1] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from longstraw_agents.app.demo import demo_train_config
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.rollout import RolloutLimits, make_env_factory, rollout_groups
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler

RESULTS = Path(__file__).parent / "results"
TARGET_SPEEDUP_AT_8 = 5.0


class PerMember:
    """A ``TorchSampler`` behind the plain ``Sampler`` protocol: the rollout loop then generates member by member."""

    def __init__(self, sampler: TorchSampler):
        self.policy_version = sampler.policy_version
        self.fork, self.generate = sampler.fork, sampler.generate
        self.append, self.num_tokens = sampler.append, sampler.num_tokens


def demo_setting(max_new_tokens: int | None) -> tuple[torch.nn.Module, dict[str, Any], SamplingConfig, int]:
    """The demo's model (random init), env kwargs and sampling, and the tokenizer's stop token."""
    config = demo_train_config("unused")
    tokenizer = load_tokenizer(config.tokenizer)
    preset = config.model.preset or "llama"
    model = build_model(TINY_PRESETS[preset](vocab_size=tokenizer.vocab_size, **config.model.overrides), seed=0)
    sampling = config.sampling
    if max_new_tokens is not None:
        sampling = sampling.model_copy(update={"max_new_tokens": max_new_tokens})
    return model, dict(config.env.kwargs), sampling, tokenizer.eos_token_id


def rollout_rate(
    model, env_kwargs: dict, sampling: SamplingConfig, stop: int, groups: int, group_size: int, batched: bool
) -> tuple[float, int]:
    """(generated tokens per second, generated tokens) of one rollout of ``groups`` groups of ``group_size``."""
    sampler = TorchSampler(model, [stop], sampling)
    policy = sampler if batched else PerMember(sampler)
    factory = make_env_factory("LongStraw/Calculator-v0", env_kwargs)
    limits = RolloutLimits(sampling.max_new_tokens)
    start = time.perf_counter()
    played = rollout_groups(factory, policy, list(range(groups)), group_size, limits, progress=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for g in played for t in g for s in t.segments if s.role == "assistant")
    return tokens / elapsed, tokens


def alternate(contenders: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Each contender's results over ``repeats`` rounds, the contenders alternating within a round."""
    out: dict[str, list[Any]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            out[name].append(run())
    return out


def rollout_table(model, env_kwargs, sampling, stop, group_sizes: Sequence[int], groups: int, repeats: int) -> dict:
    rows = {}
    for g in group_sizes:
        runs = alternate(
            {
                "batched": lambda g=g: rollout_rate(model, env_kwargs, sampling, stop, groups, g, True),
                "per_member": lambda g=g: rollout_rate(model, env_kwargs, sampling, stop, groups, g, False),
            },
            repeats,
        )
        tokens = {r[1] for results in runs.values() for r in results}
        assert len(tokens) == 1, f"the contenders generated different token counts: {tokens}"  # same draws
        batched = statistics.median(r[0] for r in runs["batched"])
        per_member = statistics.median(r[0] for r in runs["per_member"])
        speedup = batched / per_member
        rows[g] = {"batched_tok_s": batched, "per_member_tok_s": per_member, "speedup": speedup, "tokens": tokens.pop()}
    return rows


def decode_ms_per_token(model, stop: int, prompt: list[int], group: int, new_tokens: int, batched: bool) -> float:
    """Milliseconds per generated token for ``group`` members of one captured ``prompt`` (capture not timed)."""
    sampler = TorchSampler(model, [stop], SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, seed=0))
    handles = sampler.fork(prompt, group)
    start = time.perf_counter()
    generations = sampler.generate_batch(handles) if batched else [sampler.generate(h) for h in handles]
    elapsed = time.perf_counter() - start
    return 1e3 * elapsed / sum(len(g.token_ids) for g in generations)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def prompt_length_table(model, stop: int, lengths: Sequence[int], group: int, new_tokens: int, repeats: int) -> dict:
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    per_length: dict[str, list[float]] = {"batched": [], "per_member": []}
    for length in lengths:
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        runs = alternate(
            {
                "batched": lambda p=prompt: decode_ms_per_token(model, stop, p, group, new_tokens, True),
                "per_member": lambda p=prompt: decode_ms_per_token(model, stop, p, group, new_tokens, False),
            },
            repeats,
        )
        for name, values in runs.items():
            per_length[name].append(statistics.median(values))
    thousands = [length / 1000 for length in lengths]
    slopes = {name: slope(thousands, values) for name, values in per_length.items()}
    return {
        "group": group,
        "lengths": list(lengths),
        "ms_per_token": per_length,
        "slope_ms_per_1k_prompt_tokens": slopes,
        "slope_ratio": slopes["batched"] / slopes["per_member"],
        "target_ratio": 1 / group,
    }


def print_rollout(title: str, rows: dict) -> None:
    print(f"\n{title}")
    print(f"{'G':>4} {'batched tok/s':>14} {'per-member tok/s':>17} {'speedup':>8} {'tokens':>7}")
    for g, row in rows.items():
        batched, per_member = row["batched_tok_s"], row["per_member_tok_s"]
        print(f"{g:>4} {batched:>14,.0f} {per_member:>17,.0f} {row['speedup']:>7.1f}x {row['tokens']:>7}")


def print_lengths(table: dict) -> None:
    print(f"\n2) ms per generated token vs prompt length (one group of G = {table['group']})")
    print(f"{'prompt':>8} {'batched':>9} {'per-member':>11} {'ratio':>6}")
    by = table["ms_per_token"]
    for i, length in enumerate(table["lengths"]):
        batched, per_member = by["batched"][i], by["per_member"][i]
        print(f"{length:>8} {batched:>9.3f} {per_member:>11.3f} {batched / per_member:>6.2f}")
    slopes = table["slope_ms_per_1k_prompt_tokens"]
    print(
        f"slope, ms per generated token per 1k prompt tokens: batched {slopes['batched']:.4f}, per-member "
        f"{slopes['per_member']:.4f}; ratio {table['slope_ratio']:.3f} (target <= 1/G = {table['target_ratio']:.3f})"
    )


def print_targets(speedup: float, lengths_table: dict) -> None:
    ratio, target = lengths_table["slope_ratio"], lengths_table["target_ratio"]
    print(
        f"\ntargets: speedup at G = 8 (one group) {speedup:.1f}x >= {TARGET_SPEEDUP_AT_8:.0f}x: "
        f"{'met' if speedup >= TARGET_SPEEDUP_AT_8 else 'NOT met'}; slope ratio {ratio:.3f} <= {target:.3f}: "
        f"{'met' if ratio <= target else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds per setting (median reported)")
    parser.add_argument("--groups", type=int, default=8, help="groups of a demo step (table 1b)")
    parser.add_argument("--slope-group", type=int, default=8, help="G of the prompt-length table")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for rollout.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, groups, lengths, new_tokens = [1, 4, 8, 16], args.groups, [512, 2048, 8192, 16384], None
    repeats, slope_group = args.repeats, args.slope_group
    if args.quick:
        sizes, groups, lengths, new_tokens, repeats, slope_group = [1, 4], 2, [32, 96], 4, 1, 4
    model, env_kwargs, sampling, stop = demo_setting(new_tokens)
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"demo model ({parameters:.2f}M parameters), {torch.get_num_threads()} thread(s), "
        f"max_new_tokens {sampling.max_new_tokens}, {repeats} round(s)"
    )
    one = rollout_table(model, env_kwargs, sampling, stop, sizes, 1, repeats)
    print_rollout("1a) rollout tokens/s, one group of G (LongStraw/Calculator-v0)", one)
    step = rollout_table(model, env_kwargs, sampling, stop, sizes, groups, repeats)
    print_rollout(f"1b) rollout tokens/s, a demo step: {groups} groups of G played together", step)
    lengths_table = prompt_length_table(model, stop, lengths, slope_group, sampling.max_new_tokens, repeats)
    print_lengths(lengths_table)
    targets = {"speedup_at_G8": TARGET_SPEEDUP_AT_8, "slope_ratio": lengths_table["target_ratio"]}
    if 8 in one:
        print_targets(one[8]["speedup"], lengths_table)
    results = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "threads": torch.get_num_threads(),
        "max_new_tokens": sampling.max_new_tokens,
        "one_group": one,
        "demo_step": {"groups": groups, "rows": step},
        "prompt_length": lengths_table,
        "targets": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "rollout_quick.json" if args.quick else "rollout.json"
    (args.out / name).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
