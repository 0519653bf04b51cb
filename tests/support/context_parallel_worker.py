"""One rank of the context-parallel tests (tests/parallel/): the same engine calls with and without shards, the
differences written to ``out_dir/rank{r}.pt`` for the test process to check."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import ContextParallel, ParallelMesh
from longstraw_agents.planner import PlanRequest, layer_inputs_bytes
from longstraw_agents.segmenter import Member
from longstraw_agents.trainer import LossConfig, backward_group, grpo_backward, make_group
from longstraw_agents.trainer.trainer import reference_engine

OVERRIDES = {"llama": {}, "qwen3_5": {}, "glm_moe_dsa": {"index_topk": 8}}
PROMPT, BRANCH, CHUNK = 61, 7, 16


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def growing_bytes(state) -> int:
    """What a state holds per position (attention K/V, MLA rows, index keys): all but the recurrent states."""
    recurrent = {id(r): r.nbytes for chunk in state.chunks for r in chunk.recurrent if r is not None}
    return state.nbytes - sum(recurrent.values())


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def gradient(engine: Engine, prompt, completions, rewards, mode: str) -> torch.Tensor:
    engine.model.zero_grad(set_to_none=True)
    grpo_backward(engine, prompt, completions, rewards, mode, track_memory=False)
    return grads(engine.model)


def shared_turn_group(prompt: torch.Tensor, gen: torch.Generator, rewards: list[float]):
    """A group whose members share a short prompt and a first answer (loss tokens), then diverge: exact mode fuses
    the two into the prefix tree's root (a chain within one chunk), so the context's walk evaluates its loss."""
    shared = torch.randint(0, 256, (8,), generator=gen)
    members = []
    for n in (5, 9, 3):
        ids = torch.cat([prompt, shared, torch.randint(0, 256, (n,), generator=gen)])
        mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(ids) - len(prompt))]).bool()
        members.append(Member(ids.numpy(), mask.numpy()))
    return make_group(members, rewards, LossConfig(aggregation="seq-mean"))  # shared tokens weigh per member


def agent_group(prompt: torch.Tensor, gen: torch.Generator, rewards: list[float], turns: int):
    """A group shaped like agents: members share ``prompt`` and diverge at once, each growing its own history of
    ``turns`` turns (a tool output without loss, then an answer with loss): the prefix tree's leaves are long."""
    members = []
    for _ in rewards:
        ids, mask = [prompt], [torch.zeros(len(prompt))]
        for _ in range(turns):
            observation, answer = (int(n) for n in torch.randint(3, 8, (2,), generator=gen))
            ids += [torch.randint(0, 256, (observation + answer,), generator=gen)]
            mask += [torch.zeros(observation), torch.ones(answer)]
        members.append(Member(torch.cat(ids).numpy(), torch.cat(mask).bool().numpy()))
    return make_group(members, rewards, LossConfig())


def group_gradient(engine: Engine, group, mode: str) -> torch.Tensor:
    engine.model.zero_grad(set_to_none=True)
    backward_group(engine, group, mode, LossConfig(), track_memory=False)
    return grads(engine.model)


def kl_results(family: str, model, single: Engine, parallel: Engine, shards: ContextParallel, data) -> dict:
    """GRPO gradients with a KL term (beta 0.1), the reference's engine built as ``GRPOTrainer`` builds it (its
    state spread over the cp ranks as the policy's), against one process's; and the reference state a rank holds."""
    prompt, completions, rewards = data
    reference = tiny_model(family, dtype=torch.float64, seed=1, **OVERRIDES[family])
    engines = {
        name: reference_engine(reference, EngineConfig(chunk_size=CHUNK), model, engine.shards, "cpu")
        for name, engine in (("single", single), ("parallel", parallel))
    }
    results: dict[str, float] = {}
    for mode in ("exact",):  # (detached mode scores the reference by the same node loss)
        grads_of = {}
        for name, engine in (("single", single), ("parallel", parallel)):
            model.zero_grad(set_to_none=True)
            config = LossConfig(beta=0.1)
            grpo_backward(engine, prompt, completions, rewards, mode, config=config, ref_model=engines[name])
            grads_of[name] = grads(model)
        results[f"{family}/kl_{mode}"] = relative(grads_of["parallel"], grads_of["single"])
    results[f"{family}/reference_bytes"] = growing_bytes(engines["parallel"].capture(prompt))
    results[f"{family}/single_reference_bytes"] = growing_bytes(engines["single"].capture(prompt))
    return results


def agent_results(
    family: str, model, single: Engine, shards: ContextParallel, prompt, rewards, every_case: bool = True
) -> dict[str, float]:
    """Members whose own histories grow long: turn by turn (replicated extends, each piece on the rank holding the
    least of the path) and at once (a sharded extend over a parent every rank holds some of); the gradients of an
    agent-shaped group, its long leaves captured sharded or (a shorter prompt's share) replicated."""
    results: dict[str, float] = {}
    parallel = Engine(model, EngineConfig(chunk_size=CHUNK), shards=shards)
    gen = torch.Generator().manual_seed(2)
    turns = [torch.randint(0, 256, (7,), generator=gen) for _ in range(30)]
    probe = torch.randint(0, 256, (BRANCH,), generator=gen)
    state, reference = parallel.capture(prompt), single.capture(prompt)
    long_state = parallel.extend(state, torch.cat(turns[:12]))  # 84 tokens after 61: sharded, parent on every rank
    long_reference = single.extend(reference, torch.cat(turns[:12]))
    for turn in turns:  # replicated extends
        state, reference = parallel.extend(state, turn), single.extend(reference, turn)
    with torch.no_grad():
        results[f"{family}/turn_by_turn"] = relative(parallel.logits(state, probe), single.logits(reference, probe))
        results[f"{family}/long_turn"] = relative(
            parallel.logits(long_state, probe), single.logits(long_reference, probe)
        )
    results[f"{family}/turn_by_turn_bytes"] = growing_bytes(state)
    results[f"{family}/turn_by_turn_single_bytes"] = growing_bytes(reference)
    results[f"{family}/turn_by_turn_positions"] = state.positions_held(shards.ownership.size)[shards.ownership.rank]
    # leaves of 30-70 tokens after 20 shared ones (captured sharded), of 24-56 after 61 (replicated), the same with
    # EngineConfig.sharded_extend_tokens below them (sharded)
    cases = (
        ("agent", prompt[:20], 5, None, ("exact", "detached")),
        ("agent_replicated", prompt, 4, None, ("detached",)),
        ("agent_threshold", prompt, 4, 16, ("exact",)),
    )
    for name, group_prompt, turns, least, modes in cases if every_case else cases[:1]:
        group = agent_group(group_prompt, torch.Generator().manual_seed(3), rewards[:2], turns)
        engine = Engine(model, EngineConfig(chunk_size=CHUNK, sharded_extend_tokens=least), shards=shards)
        single_runs, parallel_runs = counting_layer_runs(single), counting_layer_runs(engine)
        sharded_walks = counting_sharded_walks(engine)
        for mode in modes:
            single_runs[:] = parallel_runs[:] = [0, 0]
            expected = group_gradient(single, group, mode)
            results[f"{family}/{name}_{mode}"] = relative(group_gradient(engine, group, mode), expected)
            results[f"{family}/{name}_{mode}_layer_positions"] = parallel_runs[1]
            results[f"{family}/{name}_{mode}_single_layer_positions"] = single_runs[1]
            results[f"{family}/{name}_{mode}_sharded_walks_back"] = sharded_walks[0]
            sharded_walks[0] = 0
    return results


def walk_back(engine: Engine, prompt, ids, probe, case: str) -> tuple[torch.Tensor, bool]:
    """An extend of a captured context walked back to it (``into_since``, or not: ``case`` "detached_shared",
    after a replay's gradient went into the context in the same ``StateGrad``), then the context walked; the
    parameter gradient, and whether the extend's walk ran sharded."""
    engine.model.zero_grad(set_to_none=True)
    grad = engine.new_grad()
    context = engine.capture(prompt, checkpoints=True)
    if case == "detached_shared":
        (engine.hidden(context, probe, grad=grad) ** 2).sum().backward()
    child = engine.extend(context, ids)
    weights = torch.linspace(0.5, 1.5, model_width(engine), dtype=torch.float64)

    def loss_fn(hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return (hidden * weights).sum()

    walk = engine.backward(child, grad, ids, since=context, loss_fn=loss_fn, into_since=case != "detached_shared")
    engine.backward(context, grad, prompt)
    return grads(engine.model), walk.sharded


def model_width(engine: Engine) -> int:
    return engine.model.config.hidden_size


def edge_results(family: str, model, single: Engine, shards: ContextParallel) -> dict[str, float]:
    """Sharded extends of a context walked back: of one token (one rank computes, the others only hold context
    rows), of fewer tokens than ranks on 4, of 30; and one that gives the context no gradient while a replay's
    gradient already sits in it."""
    results: dict[str, float] = {}
    parallel = Engine(model, EngineConfig(chunk_size=CHUNK, sharded_extend_tokens=1), shards=shards)
    gen = torch.Generator().manual_seed(4)
    prompt, probe = torch.randint(0, 256, (24,), generator=gen), torch.randint(0, 256, (5,), generator=gen)
    for case, n in (("one_token", 1), ("fewer_than_ranks", 3), ("long", 30), ("detached_shared", 30)):
        ids = torch.randint(0, 256, (n,), generator=gen)
        expected, _ = walk_back(single, prompt, ids, probe, case)
        got, sharded = walk_back(parallel, prompt, ids, probe, case)
        results[f"{family}/edge_{case}"] = relative(got, expected)
        results[f"{family}/edge_{case}_sharded"] = float(sharded)
    return results


def counting_sharded_walks(engine: Engine) -> list[int]:
    """A counter (one cell) of the walks back to a context (``since`` of some tokens) ``engine`` runs sharded."""
    count = [0]
    backward = engine.backward

    def counted(state, grad, ids, **kwargs):
        walk = backward(state, grad, ids, **kwargs)
        since = kwargs.get("since")
        count[0] += walk.sharded and since is not None and since.num_tokens > 0
        return walk

    engine.backward = counted  # type: ignore[method-assign]
    return count


def counting_layer_runs(engine: Engine) -> list[int]:
    """A counter of the layer evaluations ``engine`` makes from now on: ``[calls, positions evaluated]`` (the work:
    a balanced cut evaluates more, shorter pieces)."""
    count = [0, 0]
    run_layer = engine.adapter.run_layer

    def counted(*args, **kwargs):
        count[0] += 1
        count[1] += args[1].shape[0]  # (layer, hidden states, ...)
        return run_layer(*args, **kwargs)

    engine.adapter.run_layer = counted  # type: ignore[method-assign]
    return count


def run(rank: int, world: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, cp=world)
    shards = ContextParallel(mesh.cp_group, mesh.cp_channels)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (PROMPT,), generator=gen)
    branch = torch.randint(0, 256, (BRANCH,), generator=gen)
    completions = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 9, 3)]
    rewards = [1.0, 0.0, 0.5]
    results: dict[str, float | int] = {}
    many = [torch.full((2, i + 1), float(i)) for i in range(40)]  # a message of many tensors (a 40-layer hybrid's)
    got = shards.transport.broadcast_tensors(many if rank == 0 else None, 0, torch.device("cpu"))
    if rank == 0:
        shards.transport.send(many, world - 1, 7, "recurrent")
    if rank == world - 1:
        got = shards.transport.recv(0, 7, torch.device("cpu"))
    shards.transport.flush()
    results["many_tensors"] = float(max((a - b).abs().max() for a, b in zip(got, many, strict=True)))
    staged = ContextParallel(mesh.cp_group, mesh.cp_channels, host_staged=True).transport  # the same channels
    if rank == 0:
        staged.send(staged.stage(many), world - 1, 8, "recurrent")
    got = staged.recv(0, 8, torch.device("cpu"), on_host=1) if rank == world - 1 else many
    staged.flush()
    results["many_tensors_staged"] = float(max((a - b).abs().max() for a, b in zip(got, many, strict=True)))
    for family, overrides in OVERRIDES.items():
        model = tiny_model(family, dtype=torch.float64, **overrides)
        single = Engine(model, EngineConfig(chunk_size=CHUNK))
        parallel = Engine(model, EngineConfig(chunk_size=CHUNK), shards=shards)
        reference = single.capture(prompt)
        layer_runs = counting_layer_runs(parallel)
        state = parallel.capture(prompt)  # sharded compute: this rank evaluates its own chunks only
        results[f"{family}/layer_runs"] = layer_runs[0]
        results[f"{family}/own_chunks"] = sum(1 for c in state.chunks if c.owner == rank)
        results[f"{family}/layers"] = parallel.num_layers
        results[f"{family}/chunks"] = len(state.chunks)
        kept = parallel.capture(prompt, checkpoints=True)  # exact mode's capture: this rank's layer inputs kept
        own = sum(c.length for c in kept.chunks if c.owner == rank)
        request = PlanRequest(context=PROMPT, gpus=world, mode="exact", dtype=torch.float64)
        results[f"{family}/layer_inputs"] = kept.layer_inputs.nbytes
        results[f"{family}/planned_layer_inputs"] = layer_inputs_bytes(model.config, request, own)[0]
        del kept
        head = PROMPT // 3  # an extend whose parent's rows already sit on several ranks
        resumed = parallel.extend(parallel.capture(prompt[:head]), prompt[head:])
        with torch.no_grad():
            results[f"{family}/resumed"] = relative(parallel.logits(resumed, branch), single.logits(reference, branch))
        with torch.no_grad():
            results[f"{family}/logits"] = relative(parallel.logits(state, branch), single.logits(reference, branch))
            extended = parallel.extend(state, branch)  # replicated: each piece to the rank holding the least
            after = single.extend(reference, branch)
            results[f"{family}/extend"] = relative(parallel.logits(extended, branch), single.logits(after, branch))
        results[f"{family}/growing_bytes"] = growing_bytes(state)
        results[f"{family}/single_growing_bytes"] = growing_bytes(reference)
        results[f"{family}/chunk_bytes"] = growing_bytes(single.capture(prompt[:CHUNK]))
        single_runs, parallel_runs = counting_layer_runs(single), counting_layer_runs(parallel)
        for mode in ("exact", "detached"):
            single_runs[:] = parallel_runs[:] = [0, 0]
            expected = gradient(single, prompt, completions, rewards, mode)
            results[f"{family}/{mode}"] = relative(gradient(parallel, prompt, completions, rewards, mode), expected)
            # capture + branches + (exact) reverse walk
            results[f"{family}/{mode}_layer_positions"] = parallel_runs[1]
            results[f"{family}/{mode}_single_layer_positions"] = single_runs[1]
        short = prompt[:3]  # the root is 2 tokens: on 4 ranks, two hold none of it and still take part in the walk
        expected = gradient(single, short, completions, rewards, "exact")
        results[f"{family}/short_exact"] = relative(gradient(parallel, short, completions, rewards, "exact"), expected)
        results.update(agent_results(family, model, single, shards, prompt, rewards, every_case=world == 2))
        results.update(edge_results(family, model, single, shards))
        if world > 2:  # (the cases below run at cp 2 only: the suite's time)
            continue
        results |= kl_results(family, model, single, parallel, shards, (prompt, completions, rewards))
        group = shared_turn_group(prompt[:6], torch.Generator().manual_seed(1), rewards)
        model.zero_grad(set_to_none=True)
        config = LossConfig(aggregation="seq-mean")
        expected_loss = backward_group(single, group, "exact", config, track_memory=False).loss
        expected = grads(model)
        model.zero_grad(set_to_none=True)
        loss = backward_group(parallel, group, "exact", config, track_memory=False).loss
        results[f"{family}/shared_turn_exact"] = relative(grads(model), expected)
        results[f"{family}/shared_turn_loss"] = abs(loss - expected_loss)  # (on-policy seq-mean: the total is ~0)
        replicated = Engine(model, EngineConfig(chunk_size=CHUNK, wavefront_walk=False), shards=shards)
        replicated_runs = counting_layer_runs(replicated)
        expected = gradient(single, prompt, completions, rewards, "exact")
        results[f"{family}/replicated_exact"] = relative(
            gradient(replicated, prompt, completions, rewards, "exact"), expected
        )
        results[f"{family}/replicated_exact_layer_positions"] = replicated_runs[1]
        # one segment of every layer: a run recomputes each layer's input but the first's (GLM-5.2's: two MLA
        # layers, each reading its own message of the other ranks' rows)
        one_segment = EngineConfig(chunk_size=CHUNK, layer_inputs_every=len(model.model.layers))
        results[f"{family}/one_segment_exact"] = relative(
            gradient(Engine(model, one_segment, shards=shards), prompt, completions, rewards, "exact"), expected
        )
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
