"""Exact-gradient GRPO over a long agent context: NeedleSearch with a >= 32K-token shared prefix, on CPU.

The scripted policy searches and opens documents until the episode holds ``--tokens`` tokens of tool output;
from there a tiny random-init policy samples G-1 continuations and the scripted policy plays one (a reference
answer mixed into the group, so that rewards differ). The group shares the whole long prefix, and one GRPO step in
exact mode backpropagates through it with bounded memory. Run:

    python examples/needle_long_context.py --tokens 32768 --group 4
"""

import argparse
import time

import gymnasium

import longstraw_agents.envs  # noqa: F401 - registers the LongStraw ids
from longstraw_agents.envs import ScriptedPolicy, unwrap_tool_env
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import build_model, tiny_llama
from longstraw_agents.rollout import RolloutLimits, play_until_done
from longstraw_agents.sampler import SamplingConfig, TorchSampler
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer


def long_prefix(env, tokens: int, seed: int):
    """Play the scripted policy until the context holds ``tokens`` tokens (or only the answer is left)."""
    observation, _ = env.reset(seed=seed)
    policy = ScriptedPolicy(env)
    history = list(observation)
    while env.num_tokens < tokens and env.turn < len(env.scripted_turns(env.task)) - 1:
        action = policy.act()
        observation, *_ = env.step(action)
        history += list(action) + list(observation)
    return history


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768, help="shared context length to reach")
    parser.add_argument("--group", type=int, default=4, help="G continuations")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill / recompute chunk size")
    args = parser.parse_args()

    kwargs = {"target_tokens": args.tokens, "needles": 2, "max_tokens": 4 * args.tokens}
    envs = [unwrap_tool_env(gymnasium.make("LongStraw/NeedleSearch-v0", **kwargs)) for _ in range(args.group)]
    prefixes = [long_prefix(env, args.tokens, seed=7) for env in envs]
    assert all(p == prefixes[0] for p in prefixes), "the scripted prefix is deterministic"
    tokenizer = envs[0].tokenizer
    model = build_model(tiny_llama(vocab_size=tokenizer.vocab_size, hidden=64, layers=2))
    trainer = GRPOTrainer(model, GRPOConfig(G=args.group, mode="exact", chunk_size=args.chunk, lr=1e-4))
    sampler = TorchSampler(trainer.engine, [tokenizer.eos_token_id], SamplingConfig(max_new_tokens=24, seed=0))

    start = time.perf_counter()
    reference = envs[0]
    reference.step(ScriptedPolicy(reference).act())  # the scripted answer: reward 1
    handles = sampler.fork(prefixes[0], args.group - 1)  # one capture of the long prefix, forked G-1 times
    sampled = play_until_done(envs[1:], handles, sampler, RolloutLimits(max_new_tokens=24))
    group = [reference.trajectory, *sampled]
    rollout_s = time.perf_counter() - start
    rewards = [t.reward for t in group]
    print(f"shared prefix: {len(prefixes[0]):,} tokens; G={args.group}; rollout {rollout_s:.1f}s; rewards {rewards}")

    trainer.config = trainer.config.model_copy(update={"track_memory": True})
    metrics = trainer.train_step([trainer.group_from_trajectories(group)])
    state_bytes = state_size(model.config).total(len(prefixes[0]))
    print(
        f"exact GRPO step: {metrics['seconds']:.1f}s, unique tokens {metrics['unique_tokens']:,}, "
        f"loss tokens {metrics['loss_tokens']}, peak tracked {metrics['peak_bytes'] / 2**20:.1f} MiB "
        f"(prefix K/V state {state_bytes / 2**20:.1f} MiB), grad norm {metrics['grad_norm']:.3g}"
    )


if __name__ == "__main__":
    main()
