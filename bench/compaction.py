"""Training over compacting agents: a group of G NeedleSearch episodes longer than their context budget, trained as
this project's forest over their physical sequences against the way the frameworks that compact train them — each
physical sequence its own sample, one transformers forward (SDPA) and backward per sequence, loss tokens
aggregated over the group as TRL's "dapo" — side by side in one run, on the same weights.

The episodes come from the environment's own context policy (``ToolEnvConfig.context``): ``evict`` clears the
oldest tool outputs, ``summary`` asks for a summary turn at a threshold. Each member plays the scripted solution with
detours (before a scripted turn it opens a random document with probability ``--detour``, from its own generator),
so the members of a group diverge and edit at different times; a member that runs out of turns gets reward 0. GRPO
needs rewards that differ: where every episode earned the same reward (none solved the task, say) the bench says so
and trains on a synthetic reward, 1 for even members and 0 for odd ones, recorded as such in the JSON.

Printed per strategy: the episodes' logged tokens, their physical sequences and summed length, the forest's
positions, and what each side actually evaluates, counted at the model's input embedding (every evaluation starts
there): tokens run forward the first time, tokens run forward again inside exact mode's reverse walk
(``Engine.backward``: recomputed), and tokens whose gradient reached the embedding (backward). Then both step times
(the fastest of ``--repeats``), both peaks of live tensor bytes (``MemoryTracker``, a separate untimed run, the
parameters' gradients excluded) and the gradients' relative distance (they must agree).

    python -m bench.compaction [--group 8] [--budget 4096] [--quick] [--out bench/results/compaction.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from transformers import PreTrainedModel

import longstraw_agents.envs  # noqa: F401 - registers the LongStraw ids
from bench.common import bench_model, flat_grad, materialise_grads
from bench.peers import attention_implementation
from longstraw_agents.engine import Backward, Engine
from longstraw_agents.envs import ToolEnv, run_episode, unwrap_tool_env
from longstraw_agents.memory import MemoryTracker
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
        if env.awaiting_context_reply:
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


class TokenCounter:
    """The tokens a model evaluates, counted at its input embedding, where every evaluation starts (the engine's and
    transformers'): ``forward`` (first evaluations), ``recomputed`` (evaluations while ``recomputing``: exact mode's
    reverse walk) and ``backward`` (tokens whose gradient reached the embedding: backpropagated through every
    layer)."""

    PHASES = ("forward", "recomputed", "backward")

    def __init__(self, model: PreTrainedModel) -> None:
        self.embedding = model.get_input_embeddings()
        self.counts: Counter[str] = Counter()
        self.recomputing = False

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        """Count the tokens evaluated inside the block (from zero)."""
        self.counts = counts = Counter(dict.fromkeys(self.PHASES, 0))
        handle = self.embedding.register_forward_hook(self._embedded)
        try:
            yield counts
        finally:
            handle.remove()

    def _embedded(self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        tokens, counts = inputs[0].numel(), self.counts
        counts["recomputed" if self.recomputing else "forward"] += tokens
        if output.requires_grad:
            output.register_hook(lambda grad: counts.update(backward=tokens))


class CountingEngine(Engine):
    """The engine, telling ``counter`` when it evaluates inside a reverse walk (``backward``): those are
    recomputations of tokens its captures evaluated before."""

    def __init__(self, model: PreTrainedModel, counter: TokenCounter, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.counter = counter

    def backward(self, *args: Any, **kwargs: Any) -> Backward:
        self.counter.recomputing = True
        try:
            return super().backward(*args, **kwargs)
        finally:
            self.counter.recomputing = False


def group_rewards(episodes: list[Trajectory]) -> dict:
    """The rewards the group trains on: the episodes' own where they differ; otherwise (no advantage to train on)
    a synthetic reward, 1 for even members and 0 for odd ones, with why."""
    earned = [float(t.reward or 0.0) for t in episodes]
    if len(set(earned)) > 1:
        return {"earned": earned, "trained": earned, "synthetic": None}
    why = "no episode earned a reward" if earned[0] == 0.0 else f"every episode earned the same reward {earned[0]:g}"
    synthetic = [float(k % 2 == 0) for k in range(len(episodes))]
    return {"earned": earned, "trained": synthetic, "synthetic": f"{why}: 1 for even members, 0 for odd ones"}


def timed(step: Callable[[], object], model: PreTrainedModel, repeats: int) -> tuple[float, torch.Tensor]:
    """The fastest of ``repeats`` runs of ``step`` from zero gradients: seconds, the gradient."""
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best, flat_grad(model).double().clone()


def work_and_peak(step: Callable[[], object], model: PreTrainedModel, counter: TokenCounter) -> dict:
    """One untimed run of ``step``: the tokens it evaluated per phase and its peak of live tensor bytes (the
    parameters' gradients allocated before, so that neither side counts them)."""
    materialise_grads(model)
    with counter.counting() as counts, MemoryTracker() as tracker:
        step()
    return {"tokens": {phase: counts[phase] for phase in TokenCounter.PHASES}, "peak_bytes": tracker.peak_bytes}


def evaluated(work: dict) -> int:
    """Tokens run through the model, recomputations included."""
    return work["tokens"]["forward"] + work["tokens"]["recomputed"]


def measure(model: PreTrainedModel, strategy: str, episodes: list[Trajectory], chunk: int, repeats: int) -> dict:
    rewards = group_rewards(episodes)
    trained = rewards["trained"]
    counter = TokenCounter(model)
    engine = CountingEngine(model, counter, chunk_size=chunk)
    result: list[BackwardResult] = []

    def forest_step() -> None:
        result[:] = [grpo_backward_trajectories(engine, episodes, trained, mode="exact", config=LossConfig())]

    def per_sequence_step() -> None:
        per_sequence_backward(model, episodes, trained)

    forest_work = work_and_peak(forest_step, model, counter)
    per_sequence_work = work_and_peak(per_sequence_step, model, counter)
    forest_seconds, forest = timed(forest_step, model, repeats)
    per_sequence_seconds, per_sequence = timed(per_sequence_step, model, repeats)
    [stats] = result
    return {
        "strategy": strategy,
        "episodes": len(episodes),
        "rewards": rewards,
        "edits": sum(len(t.edits) for t in episodes),
        "logged_tokens": sum(t.num_tokens for t in episodes),
        "longest_sequence": max(t.num_tokens_of(s.segments) for t in episodes for s in t.physical_sequences()),
        "sequences": stats.sequences,
        "sequence_tokens": stats.sequence_tokens,
        "forest_positions": stats.unique_tokens,
        "forest_mode_forward_tokens": stats.forward_tokens,  # exact mode's own count, to check the counted one
        "forest": forest_work | {"seconds": forest_seconds},
        "per_sequence": per_sequence_work | {"seconds": per_sequence_seconds},
        "gradient_distance": float((forest - per_sequence).norm() / per_sequence.norm()),
    }


def tables(record: dict) -> list[str]:
    """The markdown tables of a run's JSON: what each side evaluates, then its time and peak."""
    lines = [
        "| strategy | logged tokens | edits | physical sequences | their tokens | forest positions |"
        " per-sequence forward / backward | forest forward / recomputed / backward |"
        " evaluated, forest / per-sequence |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        ours, theirs = r["forest"]["tokens"], r["per_sequence"]["tokens"]
        lines.append(
            f"| {r['strategy']} | {r['logged_tokens']:,} | {r['edits']} | {r['sequences']} | "
            f"{r['sequence_tokens']:,} | {r['forest_positions']:,} | {theirs['forward']:,} / {theirs['backward']:,} | "
            f"{ours['forward']:,} / {ours['recomputed']:,} / {ours['backward']:,} | "
            f"{evaluated(r['forest']) / evaluated(r['per_sequence']):.2f}× |"
        )
    lines += [
        "",
        "| strategy | per-sequence s | forest s | time, forest / per-sequence | per-sequence peak MiB |"
        " forest peak MiB | peak, forest / per-sequence | gradient distance | rewards trained |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in record["rows"]:
        ours, theirs = r["forest"], r["per_sequence"]
        trained = "synthetic" if r["rewards"]["synthetic"] else "earned"
        lines.append(
            f"| {r['strategy']} | {theirs['seconds']:.1f} | {ours['seconds']:.1f} | "
            f"{ours['seconds'] / theirs['seconds']:.2f}× | {theirs['peak_bytes'] / 2**20:.1f} | "
            f"{ours['peak_bytes'] / 2**20:.1f} | {ours['peak_bytes'] / theirs['peak_bytes']:.2f}× | "
            f"{r['gradient_distance']:.1e} | {trained} |"
        )
    return lines


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
    record = {
        "command": " ".join(["python -m bench.compaction", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"torch threads: {args.threads}",
        "budget": budget,
        "group": args.group,
        "rows": rows,
    }
    print(f"G = {args.group} NeedleSearch episodes, context budget {budget:,} tokens, tiny llama, exact mode")
    for r in rows:
        if r["rewards"]["synthetic"]:
            print(f"{r['strategy']}: {r['rewards']['synthetic']} (a synthetic reward, so that GRPO has a gradient)")
    print("\n".join(tables(record)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
