"""Training over compacting agents: a group of G NeedleSearch episodes longer than their context budget, trained as
this project's forest over their physical sequences against the way the frameworks that compact train them — each
physical sequence its own sample, one transformers forward (SDPA) and backward per sequence, loss tokens
aggregated over the group as TRL's "dapo" — side by side in one run, on the same weights.

The episodes come from the environment's own context policy (``ToolEnvConfig.context``): ``evict`` clears the
oldest tool outputs, ``summary`` asks for a summary turn at a threshold. Each member plays the scripted solution with
detours (before a scripted turn it opens a random document with probability ``--detour``, from its own generator),
so the members of a group diverge and edit at different times; a member that runs out of turns gets reward 0.
Printed per strategy: the episodes' logged tokens, their physical sequences and summed length (what the baseline
evaluates), the forest's positions, both step times (the fastest of ``--repeats``) and the gradients' relative
distance (they must agree).

    python -m bench.compaction [--group 8] [--budget 4096] [--quick] [--out bench/results/compaction.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import gymnasium
import numpy as np
import torch
from transformers import PreTrainedModel

import longstraw_agents.envs  # noqa: F401 - registers the LongStraw ids
from bench.common import bench_model, flat_grad
from bench.peers import attention_implementation
from longstraw_agents.engine import Engine
from longstraw_agents.envs import ToolEnv, run_episode, unwrap_tool_env
from longstraw_agents.tools import format_tool_call
from longstraw_agents.trainer import BackwardResult, LossConfig, grpo_backward_trajectories
from longstraw_agents.trainer.loss import group_advantages
from longstraw_agents.trajectory import Trajectory

ENV_ID = "LongStraw/NeedleSearch-v0"
# per strategy: the episode the scripted solution needs and the needles it reads (documents must fit the budget)
FULL = {"evict": {"target_tokens": 16_384, "needles": 6}, "summary": {"target_tokens": 32_768, "needles": 12}}
QUICK = {"evict": {"target_tokens": 4_096, "needles": 2}, "summary": {"target_tokens": 4_096, "needles": 2}}


class WanderingPolicy:
    """The scripted solution with detours: before a scripted turn, with probability ``detour``, it opens a random
    document instead; it writes the env's reference summary when asked for one."""

    def __init__(self, env: ToolEnv, rng: np.random.Generator, detour: float) -> None:
        self.env, self.rng, self.detour, self.played = env, rng, detour, 0

    def __call__(self, observation: object = None) -> np.ndarray:
        env = self.env
        script = env.scripted_turns(env.task)
        if env.awaiting_summary:
            text = env.scripted_summary(env.task, self.played)
        elif self.played < len(script) - 1 and self.rng.random() < self.detour:
            documents = [document.id for document in env.task.corpus]
            text = format_tool_call("open_document", {"doc_id": str(self.rng.choice(documents))})
        else:
            text, self.played = script[self.played], self.played + 1
        return env.formatter.assistant(text, env.turn).token_ids.astype(np.int64)


def compacting_group(strategy: str, size: dict, budget: int, group: int, detour: float, seed: int) -> list[Trajectory]:
    """``group`` episodes of one task, each with its own detours."""
    threshold = {"summary": {"threshold": budget * 5 // 8}}.get(strategy, {})
    context = {"max_context_tokens": budget, "strategy": {"kind": strategy, **threshold}}
    turns = 2 * size["needles"] + 1 + 2 * size["needles"] // 2 + 4  # the script, summaries, and a few detours
    episodes = []
    for member in range(group):
        env = gymnasium.make(ENV_ID, **size, max_tokens=8 * size["target_tokens"], max_turns=turns, context=context)
        policy = WanderingPolicy(unwrap_tool_env(env), np.random.default_rng([seed, member]), detour)
        episodes.append(run_episode(env, policy, seed=seed))
        env.close()
    return episodes


def per_sequence_backward(model: PreTrainedModel, episodes: list[Trajectory], rewards: list[float]) -> None:
    """The frameworks' way: every physical sequence its own sample through transformers' SDPA forward (logits from
    its first loss token on, as TRL's ``logits_to_keep``), on-policy GRPO with the episode's advantage, the group's
    loss tokens as one pool (TRL's "dapo"); one backward each."""
    advantages = group_advantages(rewards).tolist()
    rows = [
        (episode.render_sequence(sequence), advantages[k])
        for k, episode in enumerate(episodes)
        for sequence in episode.physical_sequences()
    ]
    total = sum(int(rendered.loss_mask[1:].sum()) for rendered, _ in rows)
    with attention_implementation(model, "sdpa"):
        for rendered, advantage in rows:
            ids = torch.as_tensor(rendered.token_ids, dtype=torch.long)
            # TRL's split: the "prompt" is what precedes the first loss token, logits only after it
            first = int(np.flatnonzero(rendered.loss_mask)[0])
            kept = len(ids) - first
            logits = model(input_ids=ids[None, :-1], use_cache=False, logits_to_keep=kept).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[first:, None])[:, 0]
            mask = torch.as_tensor(rendered.loss_mask[first:])
            ratio = torch.exp(logp - logp.detach())
            per_token = -torch.min(ratio * advantage, torch.clamp(ratio, 0.8, 1.2) * advantage)
            ((per_token * mask).sum() / total).backward()


def timed(step: Callable[[], object], model: PreTrainedModel, repeats: int) -> tuple[float, object, torch.Tensor]:
    """The fastest of ``repeats`` runs of ``step`` from zero gradients: seconds, its result, the gradient."""
    best, result = float("inf"), None
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        result = step()
        best = min(best, time.perf_counter() - start)
    return best, result, flat_grad(model).double().clone()


def measure(model: PreTrainedModel, strategy: str, episodes: list[Trajectory], chunk: int, repeats: int) -> dict:
    rewards = [float(t.reward or 0.0) for t in episodes]
    if len(set(rewards)) == 1:  # every member solved it (or none did): no advantage to train on
        rewards[0] = 1.0 - rewards[0]
    engine = Engine(model, chunk_size=chunk)
    forest_seconds, stats, forest = timed(
        lambda: grpo_backward_trajectories(engine, episodes, rewards, mode="exact", config=LossConfig()),
        model,
        repeats,
    )
    assert isinstance(stats, BackwardResult)
    baseline_seconds, _, baseline = timed(lambda: per_sequence_backward(model, episodes, rewards), model, repeats)
    return {
        "strategy": strategy,
        "episodes": len(episodes),
        "edits": sum(len(t.edits) for t in episodes),
        "logged_tokens": sum(t.num_tokens for t in episodes),
        "longest_sequence": max(t.num_tokens_of(s.segments) for t in episodes for s in t.physical_sequences()),
        "sequences": stats.sequences,
        "sequence_tokens": stats.sequence_tokens,
        "forest_tokens": stats.unique_tokens,
        "forest_seconds": forest_seconds,
        "per_sequence_seconds": baseline_seconds,
        "gradient_distance": float((forest - baseline).norm() / baseline.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--budget", type=int, default=4096, help="max_context_tokens")
    parser.add_argument("--detour", type=float, default=0.3)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="time each side this many times, keep the fastest")
    parser.add_argument("--quick", action="store_true", help="small episodes (CI)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/compaction.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budget = 3072 if args.quick else args.budget
    model = bench_model("llama", hidden=64 if args.quick else 128, layers=2)
    rows = []
    for strategy, size in (QUICK if args.quick else FULL).items():
        episodes = compacting_group(strategy, size, budget, args.group, args.detour, args.seed)
        rows.append(measure(model, strategy, episodes, args.chunk, args.repeats))
    print(f"G = {args.group} NeedleSearch episodes, context budget {budget:,} tokens, tiny llama, exact mode")
    print(
        "| strategy | logged tokens | edits | physical sequences | their tokens | forest tokens | fewer |"
        " per-sequence s | forest s | speed-up | gradient distance |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['logged_tokens']:,} | {r['edits']} | {r['sequences']} | "
            f"{r['sequence_tokens']:,} | {r['forest_tokens']:,} | {r['sequence_tokens'] / r['forest_tokens']:.1f}× | "
            f"{r['per_sequence_seconds']:.1f} | {r['forest_seconds']:.1f} | "
            f"{r['per_sequence_seconds'] / r['forest_seconds']:.1f}× | {r['gradient_distance']:.1e} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"budget": budget, "group": args.group, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
