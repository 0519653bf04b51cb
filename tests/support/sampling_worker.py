"""One rank of the mesh-sampling test (tests/parallel/test_fsdp.py): a tiny fp64 policy sharded with FSDP2 over a
``(dp, cp)`` mesh, sampled by every cp rank together as ``longstraw train`` samples (``parallel.sampling``): the
first cp rank leads (it alone would run the environments), the others follow its calls; the engine spreads every
member's state over the cp ranks and gathers a decoder layer at a time (with the trainer's prefetch window).
Writes what was sampled, the most decoder layers held whole, each member's positions held here, and the batched
decoder's gap to one process."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from data_parallel_worker import join
from decoding_cases import GROUPS, PROMPTS, decode_both_ways

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.fsdp import LayerGather
from longstraw_agents.parallel.sampling import FollowingSampler, LeaderFailed, LeadingSampler, SamplerCalls
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.torch_sampler import TorchHandle, TorchSampler

PROMPT, TURN, G, NEW_TOKENS, CHUNK = 19, 24, 3, 6, 8
LAYERS = 6  # more than a sharded capture gathers ahead on 2 ranks (3): a whole-model gather would show
LONG_TURN = 16  # EngineConfig.sharded_extend_tokens: the 24-token observation is computed sharded
CONFIG = EngineConfig(chunk_size=CHUNK, sharded_extend_tokens=LONG_TURN)


def script(sampler: TorchSampler, vocab: int) -> tuple[list[tuple[list[int], list[float]]], list[TorchHandle]]:
    """What a rollout asks of a sampler: G members from one prompt, a reply each (batched), a long observation
    appended to each, a second reply, the observation evicted from one member's context (resumed from a mark), and
    a last reply of that member token by token."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
    turn = torch.randint(0, vocab, (TURN,), generator=gen).tolist()
    handles = sampler.fork(prompt, G)
    first = sampler.generate_batch(handles, [NEW_TOKENS] * G)
    for handle in handles:
        sampler.append(handle, turn)
    second = sampler.generate_batch(handles, [NEW_TOKENS] * G)
    kept = PROMPT + len(first[0].token_ids)
    evicted = handles[0].history[:kept] + [1, 2, 3]
    sampler.replace_batch([handles[0]], [evicted], [kept])
    last = sampler.generate(handles[0], NEW_TOKENS)
    return [(g.token_ids, g.logprobs) for g in [*first, *second, last]], handles


def sample(engine: Engine, vocab: int) -> list[tuple[list[int], list[float]]]:
    """The script on one process (the reference)."""
    return script(TorchSampler(engine, [vocab], _sampling(), keep_marks=True), vocab)[0]


def _sampling() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=NEW_TOKENS, seed=0)


def fail_together(engine: Engine, calls: SamplerCalls, vocab: int) -> list[str]:
    """A call that fails on every rank (an edit that keeps more than the context), then a rollout that fails on the
    leader alone: the followers raise too, as soon as the leader closes, instead of waiting. Returns what each
    follower raised (the leader: nothing)."""
    raised = []
    for failing_call in (True, False):
        if calls.leads:
            sampler = LeadingSampler(engine, [vocab], _sampling(), calls=calls)
            [handle] = sampler.fork([1, 2, 3], 1)
            if failing_call:
                with contextlib.suppress(ValueError):
                    sampler.replace_batch([handle], [[1, 2]], [5])
            sampler.close(failed=True)
        else:
            try:
                FollowingSampler(engine, [vocab], _sampling(), calls=calls).follow()
            except (ValueError, LeaderFailed) as err:
                raised.append(type(err).__name__)
    return raised


def run(rank: int, world: int, port: int, out_dir: str, spec: dict[str, Any]) -> None:
    _, mesh = join(rank, world, port, spec)
    family = spec["family"]
    whole = tiny_model(family, dtype=torch.float64, seed=0, layers=LAYERS)  # one process's, the decoder's reference
    model = tiny_model(family, dtype=torch.float64, seed=0, layers=LAYERS)
    mesh.fully_shard(model)
    gather = LayerGather(model, replicas=spec["cp"])  # the trainer's: gathers started ahead for the wavefront
    engine = Engine(model, CONFIG, shards=mesh.context_parallel(), weights=gather)
    calls = SamplerCalls(mesh.cp_group)
    vocab = model.config.vocab_size
    result: dict[str, Any] = {"leads": calls.leads}
    with torch.no_grad(), gather.gathered(None):  # the root unit for the session, as Run.sampling_weights
        if calls.leads:
            sampler = LeadingSampler(engine, [vocab], _sampling(), calls=calls, keep_marks=True)
            try:
                result["generations"], handles = script(sampler, vocab)
            finally:
                sampler.close()
            states = [h.state for h in handles]
        else:
            follower = FollowingSampler(engine, [vocab], _sampling(), calls=calls, keep_marks=True)
            result["calls"] = follower.follow()
            states = [h.state for h in follower.handles]
        result["failures"] = fail_together(engine, calls, vocab)
        cp, cp_rank = mesh.cp_group.size(), mesh.cp_rank
        result["held"] = [state.positions_held(cp)[cp_rank] for state in states]
        result["lengths"] = [state.num_tokens for state in states]
        result["decoder_gap"] = decode_both_ways(engine, PROMPTS, GROUPS, reference=Engine(whole, CONFIG))
    result["most_gathered"] = gather.most_gathered
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
