"""One rank of the sharded-sampling test (tests/parallel/test_fsdp.py): a tiny fp64 policy sharded with FSDP2 over a
``(dp, cp)`` mesh; the first cp rank samples with its layers gathered one at a time (``OneRankGather``), the others
serving its gathers, as ``longstraw train`` samples (``Run.sampling_weights``). Writes what was sampled and the most
decoder layers the sampling rank held whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from data_parallel_worker import join

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.fsdp import OneRankGather
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.torch_sampler import TorchSampler

PROMPT, TURN, G, NEW_TOKENS, CHUNK = 19, 5, 3, 6, 8


def sample(engine: Engine, vocab: int) -> list[tuple[list[int], list[float]]]:
    """G members from one prompt, a tool turn appended to each, then a second reply (capture, decode, extend)."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
    turn = torch.randint(0, vocab, (TURN,), generator=gen).tolist()
    sampler = TorchSampler(engine, [vocab], SamplingConfig(max_new_tokens=NEW_TOKENS, seed=0))
    handles = sampler.fork(prompt, G)
    first = sampler.generate_batch(handles, [NEW_TOKENS] * G)
    for handle in handles:
        sampler.append(handle, turn)
    second = sampler.generate_batch(handles, [NEW_TOKENS] * G)
    return [(g.token_ids, g.logprobs) for g in first + second]


def run(rank: int, world: int, port: int, out_dir: str, spec: dict[str, Any]) -> None:
    _, mesh = join(rank, world, port, spec)
    model = tiny_model(spec["family"], dtype=torch.float64, seed=0)
    mesh.fully_shard(model)
    gather = OneRankGather(model)
    samples = mesh.cp_rank == 0
    try:  # (the rank that samples is the first of its shard group: a session elsewhere is refused before any gather)
        with gather.session(samples=not samples):
            pass
    except ValueError as err:
        refused: str | None = str(err)
    else:
        refused = None
    result: dict[str, Any] = {"samples": samples, "refused": refused}
    with gather.session(samples=samples) as weights:
        if weights is not None:
            engine = Engine(model, EngineConfig(chunk_size=CHUNK), weights=weights)
            result["generations"] = sample(engine, model.config.vocab_size)
    result["most_gathered"], result["gathers"] = gather.most_gathered, gather.gathers
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
