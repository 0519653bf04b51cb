"""One rank of the context-parallel tests (tests/parallel/): the engine calls of one process, made again with shards
over the cp ranks, the differences written to ``out_dir/rank{r}.pt`` for the test process to check.

One process's results (``references``) are the same for every rank and every mesh: the test process computes them
once, before it forks the ranks of the first mesh, and hands them to each rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import ContextParallel, ParallelMesh, parallelize
from longstraw_agents.plan import PlanRequest, layer_inputs_bytes
from longstraw_agents.segmenter import Member
from longstraw_agents.trainer import LossConfig, backward_group, grpo_backward, make_group

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


@dataclass(frozen=True)
class Inputs:
    """What every process computes on, from fixed seeds."""

    prompt: torch.Tensor
    branch: torch.Tensor
    completions: list[torch.Tensor]
    rewards: list[float]

    @staticmethod
    def make() -> Inputs:
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 256, (PROMPT,), generator=gen)
        branch = torch.randint(0, 256, (BRANCH,), generator=gen)
        completions = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 9, 3)]
        return Inputs(prompt, branch, completions, [1.0, 0.0, 0.5])

    @property
    def step(self) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
        return self.prompt, self.completions, self.rewards


def family_model(family: str) -> torch.nn.Module:
    return tiny_model(family, dtype=torch.float64, **OVERRIDES[family])


def kl_gradient(family: str, engine: Engine, inputs: Inputs) -> tuple[torch.Tensor, Engine]:
    """The exact-mode GRPO gradient with a KL term (beta 0.1), the reference placed by ``parallelize`` and its engine
    built as ``GRPOTrainer`` builds it (its state spread over the cp ranks as the policy's); and that engine.
    (Detached mode scores the reference by the same node loss.)"""
    model = engine.model
    reference_model = tiny_model(family, dtype=torch.float64, seed=1, **OVERRIDES[family])
    placement = parallelize(engine, reference_model, device="cpu")
    assert placement.reference is reference_model and not reference_model.training
    reference = Engine(reference_model, EngineConfig(chunk_size=CHUNK), shards=engine.shards)
    model.zero_grad(set_to_none=True)
    grpo_backward(engine, *inputs.step, "exact", config=LossConfig(beta=0.1), ref_model=reference)
    return grads(model), reference


def shared_turn_backward(engine: Engine, inputs: Inputs) -> tuple[torch.Tensor, float]:
    """The gradient and loss of ``shared_turn_group`` in exact mode."""
    group = shared_turn_group(inputs.prompt[:6], torch.Generator().manual_seed(1), inputs.rewards)
    engine.model.zero_grad(set_to_none=True)
    loss = backward_group(engine, group, "exact", LossConfig(aggregation="seq-mean"), track_memory=False).loss
    return grads(engine.model), loss


class AgentInputs:
    """The turns of ``agent_results``: 30 short ones after the prompt (12 of them at once, a long one), and a
    probe."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(2)
        self.turns = [torch.randint(0, 256, (7,), generator=gen) for _ in range(30)]
        self.probe = torch.randint(0, 256, (BRANCH,), generator=gen)


# the agent-shaped groups: leaves of 30-70 tokens after 20 shared ones (captured sharded), of 24-56 after 61
# (replicated), the same with EngineConfig.sharded_extend_tokens below them (sharded): name, the prompt's length,
# turns, sharded_extend_tokens, modes; the first at every cp size, the others at cp 2 only
AGENT_CASES = (
    ("agent", 20, 5, None, ("exact", "detached")),
    ("agent_replicated", PROMPT, 4, None, ("detached",)),
    ("agent_threshold", PROMPT, 4, 16, ("exact",)),
)
# the sharded extends of a context walked back (``walk_back``): name, tokens
EDGE_CASES = (("one_token", 1), ("fewer_than_ranks", 3), ("long", 30), ("detached_shared", 30))


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


def edge_inputs() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    prompt, probe = torch.randint(0, 256, (24,), generator=gen), torch.randint(0, 256, (5,), generator=gen)
    return prompt, probe, {case: torch.randint(0, 256, (n,), generator=gen) for case, n in EDGE_CASES}


def references(family: str) -> dict[str, Any]:
    """One process's results for ``family`` (every case, the cp 2 ones included): logits, gradients, bytes held,
    and the positions its layers evaluate."""
    inputs = Inputs.make()
    prompt, branch = inputs.prompt, inputs.branch
    model = family_model(family)
    single = Engine(model, EngineConfig(chunk_size=CHUNK))
    expected: dict[str, Any] = {}
    reference = single.capture(prompt)
    with torch.no_grad():
        expected["logits"] = single.logits(reference, branch)
        expected["extend"] = single.logits(single.extend(reference, branch), branch)
    expected["growing_bytes"] = growing_bytes(reference)
    expected["chunk_bytes"] = growing_bytes(single.capture(prompt[:CHUNK]))
    runs = counting_layer_runs(single)
    for mode in ("exact", "detached"):
        runs[:] = [0, 0]
        expected[mode] = gradient(single, *inputs.step, mode)
        expected[f"{mode}_layer_positions"] = runs[1]  # capture + branches + (exact) reverse walk
    expected["short_exact"] = gradient(single, prompt[:3], inputs.completions, inputs.rewards, "exact")
    # a member's history: turn by turn, and 12 turns at once
    agent = AgentInputs()
    state = single.capture(prompt)
    long_state = single.extend(state, torch.cat(agent.turns[:12]))
    for turn in agent.turns:
        state = single.extend(state, turn)
    with torch.no_grad():
        expected["turn_by_turn"] = single.logits(state, agent.probe)
        expected["long_turn"] = single.logits(long_state, agent.probe)
    expected["turn_by_turn_bytes"] = growing_bytes(state)
    for name, prompt_length, turns, _, modes in AGENT_CASES:
        group = agent_group(prompt[:prompt_length], torch.Generator().manual_seed(3), inputs.rewards[:2], turns)
        for mode in modes:
            runs[:] = [0, 0]
            expected[f"{name}_{mode}"] = group_gradient(single, group, mode)
            expected[f"{name}_{mode}_layer_positions"] = runs[1]
    edge_prompt, probe, edge_ids = edge_inputs()
    for case, ids in edge_ids.items():
        expected[f"edge_{case}"], _ = walk_back(single, edge_prompt, ids, probe, case)
    expected["kl_exact"], kl_engine = kl_gradient(family, single, inputs)
    expected["reference_bytes"] = growing_bytes(kl_engine.capture(prompt))
    expected["shared_turn_exact"], expected["shared_turn_loss"] = shared_turn_backward(single, inputs)
    return expected


def agent_results(family: str, model, shards: ContextParallel, inputs: Inputs, expected: dict, every_case: bool):
    """Members whose own histories grow long: turn by turn (replicated extends, each piece on the rank holding the
    least of the path) and at once (a sharded extend over a parent every rank holds some of); the gradients of an
    agent-shaped group, its long leaves captured sharded or (a shorter prompt's share) replicated."""
    results: dict[str, float] = {}
    parallel = Engine(model, EngineConfig(chunk_size=CHUNK), shards=shards)
    agent = AgentInputs()
    state = parallel.capture(inputs.prompt)
    long_state = parallel.extend(state, torch.cat(agent.turns[:12]))  # 84 tokens after 61: sharded, parent everywhere
    for turn in agent.turns:  # replicated extends
        state = parallel.extend(state, turn)
    with torch.no_grad():
        results[f"{family}/turn_by_turn"] = relative(parallel.logits(state, agent.probe), expected["turn_by_turn"])
        results[f"{family}/long_turn"] = relative(parallel.logits(long_state, agent.probe), expected["long_turn"])
    results[f"{family}/turn_by_turn_bytes"] = growing_bytes(state)
    results[f"{family}/turn_by_turn_single_bytes"] = expected["turn_by_turn_bytes"]
    results[f"{family}/turn_by_turn_positions"] = state.positions_held(shards.ownership.size)[shards.ownership.rank]
    for name, prompt_length, turns, least, modes in AGENT_CASES if every_case else AGENT_CASES[:1]:
        group = agent_group(inputs.prompt[:prompt_length], torch.Generator().manual_seed(3), inputs.rewards[:2], turns)
        engine = Engine(model, EngineConfig(chunk_size=CHUNK, sharded_extend_tokens=least), shards=shards)
        runs, sharded_walks = counting_layer_runs(engine), counting_sharded_walks(engine)
        for mode in modes:
            runs[:], sharded_walks[0] = [0, 0], 0
            case = f"{name}_{mode}"
            results[f"{family}/{case}"] = relative(group_gradient(engine, group, mode), expected[case])
            results[f"{family}/{case}_layer_positions"] = runs[1]
            results[f"{family}/{case}_single_layer_positions"] = expected[f"{case}_layer_positions"]
            results[f"{family}/{case}_sharded_walks_back"] = sharded_walks[0]
    return results


def edge_results(family: str, model, shards: ContextParallel, expected: dict) -> dict[str, float]:
    """Sharded extends of a context walked back: of one token (one rank computes, the others only hold context
    rows), of fewer tokens than ranks on 4, of 30; and one that gives the context no gradient while a replay's
    gradient already sits in it."""
    results: dict[str, float] = {}
    parallel = Engine(model, EngineConfig(chunk_size=CHUNK, sharded_extend_tokens=1), shards=shards)
    prompt, probe, edge_ids = edge_inputs()
    for case, ids in edge_ids.items():
        got, sharded = walk_back(parallel, prompt, ids, probe, case)
        results[f"{family}/edge_{case}"] = relative(got, expected[f"edge_{case}"])
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


def family_results(
    family: str, rank: int, world: int, shards: ContextParallel, expected: dict[str, Any]
) -> dict[str, float | int]:
    """Each sharded result of ``family`` against one process's (``expected``), and what this rank held and ran."""
    inputs = Inputs.make()
    prompt, branch = inputs.prompt, inputs.branch
    model = family_model(family)
    parallel = Engine(model, EngineConfig(chunk_size=CHUNK), shards=shards)
    results: dict[str, float | int] = {}
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
        results[f"{family}/resumed"] = relative(parallel.logits(resumed, branch), expected["logits"])
        results[f"{family}/logits"] = relative(parallel.logits(state, branch), expected["logits"])
        extended = parallel.extend(state, branch)  # replicated: each piece to the rank holding the least
        results[f"{family}/extend"] = relative(parallel.logits(extended, branch), expected["extend"])
    results[f"{family}/growing_bytes"] = growing_bytes(state)
    results[f"{family}/single_growing_bytes"] = expected["growing_bytes"]
    results[f"{family}/chunk_bytes"] = expected["chunk_bytes"]
    parallel_runs = counting_layer_runs(parallel)
    for mode in ("exact", "detached"):
        parallel_runs[:] = [0, 0]
        results[f"{family}/{mode}"] = relative(gradient(parallel, *inputs.step, mode), expected[mode])
        # capture + branches + (exact) reverse walk
        results[f"{family}/{mode}_layer_positions"] = parallel_runs[1]
        results[f"{family}/{mode}_single_layer_positions"] = expected[f"{mode}_layer_positions"]
    # the root is 2 tokens: on 4 ranks, two hold none of it and still take part in the walk
    short = gradient(parallel, prompt[:3], inputs.completions, inputs.rewards, "exact")
    results[f"{family}/short_exact"] = relative(short, expected["short_exact"])
    results |= agent_results(family, model, shards, inputs, expected, every_case=world == 2)
    results |= edge_results(family, model, shards, expected)
    if world > 2:  # (the cases below run at cp 2 only: the suite's time)
        return results
    kl, kl_engine = kl_gradient(family, parallel, inputs)
    results[f"{family}/kl_exact"] = relative(kl, expected["kl_exact"])
    results[f"{family}/reference_bytes"] = growing_bytes(kl_engine.capture(prompt))
    results[f"{family}/single_reference_bytes"] = expected["reference_bytes"]
    shared_turn, loss = shared_turn_backward(parallel, inputs)
    results[f"{family}/shared_turn_exact"] = relative(shared_turn, expected["shared_turn_exact"])
    # (on-policy seq-mean: the total is ~0)
    results[f"{family}/shared_turn_loss"] = abs(loss - expected["shared_turn_loss"])
    replicated = Engine(model, EngineConfig(chunk_size=CHUNK, wavefront_walk=False), shards=shards)
    replicated_runs = counting_layer_runs(replicated)
    results[f"{family}/replicated_exact"] = relative(gradient(replicated, *inputs.step, "exact"), expected["exact"])
    results[f"{family}/replicated_exact_layer_positions"] = replicated_runs[1]
    # one segment of every layer: a run recomputes each layer's input but the first's (GLM-5.2's: two MLA layers,
    # each reading its own message of the other ranks' rows)
    one_segment = EngineConfig(chunk_size=CHUNK, layer_inputs_every=len(model.model.layers))
    results[f"{family}/one_segment_exact"] = relative(
        gradient(Engine(model, one_segment, shards=shards), *inputs.step, "exact"), expected["exact"]
    )
    return results


def many_tensors(rank: int, world: int, mesh: ParallelMesh, shards: ContextParallel) -> dict[str, float]:
    """A message of many tensors (a 40-layer hybrid's), broadcast and sent point to point, then staged through host
    memory: the largest difference from what was sent."""
    many = [torch.full((2, i + 1), float(i)) for i in range(40)]
    got = shards.transport.broadcast_tensors(many if rank == 0 else None, 0, torch.device("cpu"))
    if rank == 0:
        shards.transport.send(many, world - 1, 7, "recurrent")
    if rank == world - 1:
        got = shards.transport.recv(0, 7, torch.device("cpu"))
    shards.transport.flush()
    results = {"many_tensors": float(max((a - b).abs().max() for a, b in zip(got, many, strict=True)))}
    staged = ContextParallel(mesh.cp_group, mesh.cp_channels, host_staged=True).transport  # the same channels
    if rank == 0:
        staged.send(staged.stage(many), world - 1, 8, "recurrent")
    got = staged.recv(0, 8, torch.device("cpu"), on_host=1) if rank == world - 1 else many
    staged.flush()
    results["many_tensors_staged"] = float(max((a - b).abs().max() for a, b in zip(got, many, strict=True)))
    return results


def run(rank: int, world: int, store: str, out_dir: str, expected: dict[str, dict[str, Any]]) -> None:
    """``expected``: ``references`` of every family."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, cp=world)
    shards = ContextParallel(mesh.cp_group, mesh.cp_channels)
    results: dict[str, float | int] = many_tensors(rank, world, mesh, shards)
    for family in OVERRIDES:
        results |= family_results(family, rank, world, shards, expected[family])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
