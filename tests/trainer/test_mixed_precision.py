"""Mixed precision on one process (``parallel.mixed_precision.ComputeCopy``): the engine computes with a copy in the
compute dtype, AdamW steps the model's own (master) weights with moments in their dtype, and every backward pass's
gradient is summed into the masters in their dtype. The sharded version (FSDP2's policy) is compared with this one
in tests/trainer/test_data_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
from calculator_group import G, answer_logprobs, calculator_group

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.mixed_precision import ComputeCopy
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer, backward_group


def _trainer(model: torch.nn.Module, lr: float, **config) -> GRPOTrainer:
    return GRPOTrainer(model, GRPOConfig(G=G, chunk_size=32, lr=lr, max_grad_norm=None, **config))


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_the_masters_gradient_is_each_backward_pass_of_the_copy_summed_in_the_masters_dtype(mode: str) -> None:
    """fp64 masters, fp32 compute: after a step the masters hold, in fp64, the sum over the step's backward passes
    of the fp32 copy's gradients — the same as the fp32 model's own gradient up to fp32's rounding of the sum — and
    the copy holds the stepped masters rounded to fp32."""
    group, vocab_size = calculator_group()
    master = tiny_model("llama", dtype=torch.float64, seed=0, vocab_size=vocab_size)
    in_fp32 = copy.deepcopy(master).float()
    trainer = _trainer(master, 1e-3, mode=mode, mixed_precision={"compute_dtype": "float32"})
    trainer.train_step([trainer.group_from_trajectories(group)])
    reference = _trainer(in_fp32, 1e-3, mode=mode)
    backward_group(reference.engine, reference.group_from_trajectories(group), mode, reference.config.loss)
    for (name, p), ref in zip(master.named_parameters(), in_fp32.parameters(), strict=True):
        assert p.dtype == p.grad.dtype == torch.float64, name
        torch.testing.assert_close(p.grad, ref.grad.double(), rtol=1e-4, atol=1e-6, msg=name)
    for low, high in zip(trainer.engine.model.parameters(), master.parameters(), strict=True):
        assert low.dtype == torch.float32 and low.grad is None
        assert torch.equal(low, high.float())
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()] + [
        s["exp_avg_sq"] for s in trainer.optimizer.state.values()
    ]
    assert moments and all(m.dtype == torch.float64 for m in moments)


def test_updates_below_bf16_resolution_accumulate_in_fp32_masters() -> None:
    """AdamW's first step moves each weight by about lr. At lr 1e-6 that is below bf16's resolution for the weights
    of a tiny model (~1e-4 at 0.02): a model stepped in bf16 keeps nearly every weight, fp32 masters take the step."""
    group, vocab_size = calculator_group()
    fp32 = tiny_model("llama", seed=0, vocab_size=vocab_size)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    moved = {}
    for name, model, config in (("mixed", fp32, {"bf16": True}), ("bf16", bf16, {})):
        before = [p.detach().clone() for p in model.parameters()]
        trainer = _trainer(model, 1e-6, **config)
        trainer.train_step([trainer.group_from_trajectories(group)])
        changed = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before, strict=True))
        moved[name] = changed / sum(b.numel() for b in before)
    assert moved["mixed"] > 0.5 and moved["bf16"] < 0.05, moved


def test_a_bf16_mixed_precision_run_learns_and_resumes_from_its_masters(tmp_path) -> None:
    """Three steps in bf16 mixed precision raise the rewarded answers (as tests/trainer/test_learning.py asks of
    fp32), and a checkpoint holds the fp32 masters: loaded into a fresh trainer, its compute copy is refreshed."""
    group, vocab_size = calculator_group()
    model = tiny_model("llama", seed=0, vocab_size=vocab_size)
    before = answer_logprobs(model, group)
    trainer = _trainer(model, 1e-3, bf16=True)
    for _ in range(3):
        trainer.train_step([trainer.group_from_trajectories(group)])
    change = answer_logprobs(model, group) - before
    assert (change[: G // 2] > 1.0).all() and (change[G // 2 :] < -0.1).all(), change.tolist()
    trainer.save_checkpoint(tmp_path / "checkpoint")
    fresh = _trainer(tiny_model("llama", seed=1, vocab_size=vocab_size), 1e-3, bf16=True)
    fresh.load_checkpoint(tmp_path / "checkpoint")
    for a, b in zip(fresh.model.parameters(), model.parameters(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    for a, b in zip(fresh.engine.model.parameters(), trainer.engine.model.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_mixed_precision_needs_wider_masters_and_one_way_to_say_it() -> None:
    with pytest.raises(ValueError, match="already have"):
        ComputeCopy(tiny_model("llama", dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or mixed_precision"):
        GRPOConfig(bf16=True, mixed_precision={"compute_dtype": "bfloat16"})
    assert GRPOConfig(bf16=True).mixed_precision == GRPOConfig(mixed_precision={}).mixed_precision
    assert GRPOConfig(bf16=False).mixed_precision is None
