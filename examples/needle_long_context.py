"""End-to-end GRPO over a long agent context: LongStraw/NeedleSearch-v0 with a >= 32K-token shared prefix, on CPU.

Each step rolls out one group of episodes of a fresh NeedleSearch task. The scripted policy searches and opens
the needle documents until the shared context holds at least ``--tokens`` tokens (the task is rebuilt larger
until it does; the length is asserted). From there a tiny random-init Llama samples G-1 continuations through
the engine (one capture of the prefix, forked G-1 times) and the scripted answer is the G-th member, so that the
rewards differ. The shared prefix is context: its scripted assistant turns carry no loss, only the continuations
do. The episodes go to a Store in ``--out``, then one GRPO step in exact mode backpropagates through the whole
prefix, chunk by chunk, with memory set by the chunk and the K/V state, not by G. Per step it prints the rewards,
loss (on-policy its value is fixed by the advantages; the gradient is what counts), tokens, peak tracked memory
and times. At 32K tokens a step takes 2-3 minutes on one CPU thread (peak tracked ~100 MiB). Run:

    python examples/needle_long_context.py --tokens 32768 --group 4 --steps 2 --out runs/needle
    longstraw inspect runs/needle/trajectories.db --transcript
"""

import argparse
import time
from pathlib import Path

import gymnasium

import longstraw_agents.envs  # noqa: F401 - registers the LongStraw ids
from longstraw_agents.app.replay import as_context
from longstraw_agents.envs import ScriptedPolicy, ToolEnv, unwrap_tool_env
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import build_model, tiny_llama
from longstraw_agents.rollout import RolloutLimits, play_until_done
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.store import Store
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer

ENV_ID = "LongStraw/NeedleSearch-v0"
MiB = 2**20


def make_env(target_tokens: int) -> ToolEnv:
    return unwrap_tool_env(gymnasium.make(ENV_ID, target_tokens=target_tokens, needles=2))


def scripted_prefix(env: ToolEnv, seed: int, options: dict) -> tuple[list[int], int]:
    """Reset ``env`` and play every scripted turn but the answer; returns the context's ids and its turn count."""
    observation, _ = env.reset(seed=seed, options=options)
    history, policy = observation.tolist(), ScriptedPolicy(env)
    while env.turn < len(env.scripted_turns(env.task)) - 1:
        action = policy.act()
        observation, *_ = env.step(action)
        history += action.tolist() + observation.tolist()
    return history, env.turn


def long_group(tokens: int, size: int, seed: int, options: dict) -> tuple[list[ToolEnv], list[int], int]:
    """``size`` envs at the end of the same scripted prefix of at least ``tokens`` tokens."""
    target = tokens
    while True:  # the env sizes its documents to about target_tokens: grow the target until the prefix suffices
        first = make_env(target)
        prefix, turns = scripted_prefix(first, seed, options)
        if len(prefix) >= tokens:
            break
        target += tokens - len(prefix) + 64
    envs = [first, *(make_env(target) for _ in range(size - 1))]
    assert all(scripted_prefix(env, seed, options)[0] == prefix for env in envs[1:]), "the scripted prefix is seeded"
    assert len(prefix) >= tokens, f"prefix {len(prefix)} < {tokens} tokens"
    return envs, prefix, turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="shared context length to reach (>= 2112)")
    parser.add_argument("--group", type=int, default=4, help="G: members per group (G-1 sampled + the script)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (one new task and group each)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill / recompute chunk size")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per sampled assistant turn")
    parser.add_argument("--seed", type=int, default=7, help="task seed of the first step")
    parser.add_argument("--out", type=Path, default=Path("runs/needle_long_context"), help="output directory")
    args = parser.parse_args(argv)
    if args.group < 2:
        parser.error("--group must be >= 2")

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    store = Store.open(args.out / "trajectories.db")
    tokenizer = make_env(args.tokens).tokenizer
    model = build_model(tiny_llama(vocab_size=tokenizer.vocab_size, hidden=64, layers=2))
    config = GRPOConfig(G=args.group, mode="exact", chunk_size=args.chunk, lr=1e-4, track_memory=True)
    trainer = GRPOTrainer(model, config)
    run_id = store.add_run(
        config={"example": "needle_long_context", **vars(args), "out": str(args.out)},
        model="tiny_llama(hidden=64, layers=2), random init",
        tokenizer=tokenizer.name,
    )
    limits = RolloutLimits(max_new_tokens=args.max_new_tokens)
    peak = 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        options = {"group_id": f"{run_id}-step{step}", "policy_version": trainer.policy_version}
        envs, prefix, turns = long_group(args.tokens, args.group, args.seed + step, options)
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, seed=step)
        sampler = TorchSampler(
            trainer.engine, [tokenizer.eos_token_id], sampling, policy_version=trainer.policy_version
        )
        reference = envs[0]
        reference.step(ScriptedPolicy(reference).act())  # the scripted answer: reward 1
        handles = sampler.fork(prefix, args.group - 1)  # one capture of the long prefix, forked G-1 times
        played = [reference.trajectory, *play_until_done(envs[1:], handles, sampler, limits)]
        group = [as_context(t, turns) for t in played]  # the shared prefix is context: no loss on its turns
        assert all(t.completion_start() >= len(prefix) >= args.tokens for t in group)
        store.add_episodes(group, run_id=run_id)
        rollout_s = time.perf_counter() - t0

        metrics = trainer.train_step([trainer.group_from_trajectories(group)])
        peak = max(peak, metrics.peak_bytes)
        rewards = " ".join(f"{t.reward:.0f}" for t in group)
        print(
            f"step {step + 1}/{args.steps}: prefix {len(prefix):,} tokens ({turns} scripted turns), G={args.group}, "
            f"rewards [{rewards}], rollout {rollout_s:.1f}s | exact GRPO: loss {metrics.loss:+.4f}, "
            f"loss tokens {metrics.loss_tokens}, unique tokens {metrics.unique_tokens:,}, "
            f"forward tokens {metrics.forward_tokens:,}, peak tracked {metrics.peak_bytes / MiB:.1f} MiB, "
            f"grad norm {metrics.grad_norm:.3g}, {metrics.seconds:.1f}s",
            flush=True,
        )
    episodes = store.count("run_id = ?", [run_id])
    store.close()
    kv = state_size(model.config).total(len(prefix)) / MiB
    print(
        f"done: {args.steps} steps, {episodes} episodes in {args.out / 'trajectories.db'} (run {run_id}); "
        f"peak tracked {peak / MiB:.1f} MiB (prefix K/V state at {len(prefix):,} tokens: {kv:.1f} MiB); "
        f"wall time {time.perf_counter() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
