"""GRPO learns: optimizer steps on a fixed Calculator group raise the likelihood of the rewarded answers and lower
that of the unrewarded ones, in every mode.

A learning test that float rounding cannot flip: the batch is fixed (scripted episodes, rewards from the env),
so no sampling decides whether there is a learning signal, and the asserted changes are first-order effects of the
update, far larger than any rounding difference. It must hold on any CPU (``ATEN_CPU_CAPABILITY``), at one or two
threads, and from initial weights moved by one ulp — the local stand-ins for another machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from calculator_group import G, answer_logprobs, calculator_group

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer import MODES, GRPOConfig, GRPOTrainer

STEPS = 3
# How far each member's log-likelihood (nats) must move in STEPS steps. Measured here (every mode, 1 or 2 threads,
# init or init + 1 ulp): the rewarded answers rise by 2.1-2.3, the unrewarded fall by 0.22-0.59 (each wrong number
# loses what the right one gains, shared among four). Rounding moves these by less than 1e-4.
RISE, FALL = 1.0, 0.1


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def nudged_by_one_ulp(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, torch.inf)))
    return model


# Local stand-ins for another machine: thread count (the reduction order of every parallel op) and the initial
# weights moved by one ulp, over the demo's mode; the other modes at the default count.
MACHINES = [
    pytest.param("exact", threads, nudge, id=f"exact-{threads}threads{'-init+1ulp' if nudge else ''}")
    for threads in (1, 2)
    for nudge in (False, True)
] + [pytest.param(mode, 2, False, id=mode) for mode in sorted(MODES) if mode != "exact"]


@pytest.mark.parametrize(("mode", "threads", "nudge"), MACHINES, indirect=["threads"])
def test_grpo_steps_raise_the_rewarded_answers_and_lower_the_others(mode: str, nudge: bool, threads: int) -> None:
    group, vocab_size = calculator_group()
    model = tiny_model("llama", seed=0, vocab_size=vocab_size)
    if nudge:
        nudged_by_one_ulp(model)
    before = answer_logprobs(model, group)
    trainer = GRPOTrainer(model, GRPOConfig(G=G, mode=mode, chunk_size=32, lr=1e-3, max_grad_norm=1.0))
    for _ in range(STEPS):
        trainer.train_step([trainer.group_from_trajectories(group)])
    change = answer_logprobs(model, group) - before
    solved, failed = change[: G // 2], change[G // 2 :]
    assert (solved > RISE).all(), f"rewarded answers' log-likelihood changes: {solved.tolist()}"
    assert (failed < -FALL).all(), f"unrewarded answers' log-likelihood changes: {failed.tolist()}"
