"""The real ``trl.GRPOTrainer`` (TRL 1.16, from PyPI) against this project's trainer: the gradient of TRL's own loss
(``GRPOTrainer._compute_loss`` on a prepared batch: prompt/completion ids and masks, advantages, behaviour and
reference log-probs) equals the gradient ``GRPOTrainer.train_step`` applies, in naive and exact mode, for every TRL
loss type, with and without the KL term, off-policy (some ratios clipped), in fp32.

Nothing is downloaded: the policy is a tiny random-init llama saved to a temporary directory (TRL loads its own
reference copy from there when beta > 0), the tokenizer a word-level ``tokenizers`` model built here. Both sides get
the same advantages (this project's ``group_advantages``) and reference log-probs, so what is compared is the loss:
its ratio, clipping, KL term with TRL 1.16's bias correction, and each loss type's normalisation over a batch of two
groups (TRL's micro-batch; ``loss_type`` names select this project's batch normalisation).
"""

from __future__ import annotations

import copy
from pathlib import Path

import datasets
import pytest
import torch
import trl
from grpo_reference import parameter_grads, relative_l2
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer, group_advantages

G = 4
VOCAB = 256
PROMPTS = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]  # equal lengths: TRL left-pads prompts of unequal length
COMPLETIONS = [
    [[20, 21, 22], [23, 24], [25, 26, 27, 28, 29], [30]],
    [[40, 41], [42, 43, 44, 45], [46], [47, 48, 49]],
]
REWARDS = [[1.0, 0.0, 0.5, 0.25], [0.0, 1.0, 0.75, 0.0]]
BETA = 0.04
TOLERANCE = 3e-6  # relative L2 of the whole gradient, fp32 (two forward implementations of one model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", dtype=torch.float32, seed=3).save_pretrained(path)
    return path


def local_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t1", eos_token="t2", unk_token="t0")


def load(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def reference_model(checkpoint: Path) -> torch.nn.Module:
    """A frozen reference that differs from the policy (so the KL term and its gradient are not zero)."""
    ref = load(checkpoint)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return ref.eval().requires_grad_(False)


def completion_logps(model: torch.nn.Module) -> list[list[Tensor]]:
    """log p of each completion's tokens given its prompt, one full forward per member (no graph)."""
    out = []
    with torch.no_grad():
        for prompt, completions in zip(PROMPTS, COMPLETIONS, strict=True):
            rows = []
            for completion in completions:
                ids = torch.tensor(prompt + completion)
                logits = model(ids.unsqueeze(0)).logits[0, len(prompt) - 1 : -1].double()
                rows.append(torch.log_softmax(logits, -1).gather(-1, ids[len(prompt) :, None])[:, 0])
            out.append(rows)
    return out


def behaviour_logps(policy: torch.nn.Module) -> list[list[Tensor]]:
    """The policy's own log-probs moved by noise: ratios spread over [0.5, 2], many outside the clip range."""
    generator = torch.Generator().manual_seed(11)
    return [
        [lp + 0.35 * torch.randn(lp.shape, generator=generator, dtype=torch.float64) for lp in group]
        for group in completion_logps(policy)
    ]


def padded(rows: list[Tensor], width: int) -> Tensor:
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


def trl_inputs(old: list[list[Tensor]], ref: list[list[Tensor]]) -> dict[str, Tensor]:
    """The batch ``GRPOTrainer._compute_loss`` reads: both groups in one micro-batch, completions right-padded."""
    completions = [c for group in COMPLETIONS for c in group]
    width = max(len(c) for c in completions)
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    prompt_ids = torch.tensor([p for p in PROMPTS for _ in range(G)])
    advantages = torch.cat([group_advantages(r) for r in REWARDS]).float()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": torch.tensor([c + [1] * (width - len(c)) for c in completions]),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": padded([lp for group in old for lp in group], width).float(),
        "ref_per_token_logps": padded([lp for group in ref for lp in group], width).float(),
        "num_items_in_batch": mask.sum(),
    }


def trl_gradient(checkpoint: Path, loss_type: str, beta: float, inputs: dict[str, Tensor], tmp: Path) -> dict:
    args = trl.GRPOConfig(
        output_dir=str(tmp / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's default runs the loss under bf16 autocast; the comparison is in fp32
        per_device_train_batch_size=2 * G,
        num_generations=G,
        loss_type=loss_type,
        beta=beta,
    )
    assert (args.max_completion_length, args.use_bias_correction_kl) == (512, True)  # TRL 1.16's defaults
    trainer = trl.GRPOTrainer(
        model=load(checkpoint),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["t3 t4"] * G}),
        processing_class=local_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run here
    trainer.model.train()
    trainer._compute_loss(trainer.model, inputs).backward()
    return parameter_grads(trainer.model)


def our_gradient(
    checkpoint: Path, loss_type: str, beta: float, mode: str, old: list[list[Tensor]], ref_model: torch.nn.Module
) -> dict:
    """The gradient ``train_step`` hands to the optimizer (its step is replaced by a recorder: AdamW would hide the
    gradient's scale)."""
    policy = load(checkpoint)
    config = GRPOConfig(group_size=G, mode=mode, loss_type=loss_type, beta=beta, max_grad_norm=None, chunk_size=4)
    trainer = GRPOTrainer(policy, config, ref_model=copy.deepcopy(ref_model) if beta else None)
    recorded: dict = {}
    trainer.optimizer.step = lambda *a, **k: recorded.update(parameter_grads(trainer.engine.model))
    groups = [
        trainer.group_from_completions(prompt, completions, rewards, old_logprobs=lps)
        for prompt, completions, rewards, lps in zip(PROMPTS, COMPLETIONS, REWARDS, old, strict=True)
    ]
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # the recorder never steps
        trainer.train_step(groups)
    return recorded


@pytest.fixture(scope="module")
def batch(checkpoint: Path):
    policy = load(checkpoint)
    ref_model = reference_model(checkpoint)
    old = behaviour_logps(policy)
    return old, ref_model, trl_inputs(old, completion_logps(ref_model))


@pytest.mark.parametrize("beta", [0.0, BETA], ids=["no-kl", "kl"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_gradients_match_trl_for_every_loss_type(checkpoint: Path, batch, loss_type: str, beta: float, tmp_path):
    old, ref_model, inputs = batch
    ratio = torch.exp(torch.cat([lp for g in completion_logps(load(checkpoint)) for lp in g]) - torch.cat(sum(old, [])))
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()  # clipped and not
    expected = trl_gradient(checkpoint, loss_type, beta, inputs, tmp_path)
    for mode in ("naive", "exact"):
        actual = our_gradient(checkpoint, loss_type, beta, mode, old, ref_model)
        assert relative_l2(actual, expected) < TOLERANCE, (mode, relative_l2(actual, expected))


def test_the_comparison_sees_the_kl_bias_correction_and_the_normaliser(checkpoint: Path, batch, tmp_path) -> None:
    """The controls: TRL before 1.16 (plain k3, max_completion_length 256) gives gradients this test tells apart."""
    old, ref_model, inputs = batch
    expected = trl_gradient(checkpoint, "dr_grpo", BETA, inputs, tmp_path)
    policy = load(checkpoint)
    for change in ({"use_bias_correction_kl": False}, {"max_completion_length": 256}):
        config = GRPOConfig(group_size=G, mode="exact", loss_type="dr_grpo", beta=BETA, max_grad_norm=None, **change)
        trainer = GRPOTrainer(copy.deepcopy(policy), config, ref_model=copy.deepcopy(ref_model))
        recorded: dict = {}
        trainer.optimizer.step = lambda *a, **k: recorded.update(parameter_grads(trainer.engine.model))  # noqa: B023
        groups = [
            trainer.group_from_completions(p, c, r, old_logprobs=lp)
            for p, c, r, lp in zip(PROMPTS, COMPLETIONS, REWARDS, old, strict=True)
        ]
        with pytest.warns(UserWarning, match="lr_scheduler.step"):
            trainer.train_step(groups)
        assert relative_l2(recorded, expected) > 100 * TOLERANCE, change
