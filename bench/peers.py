"""The peers ``bench/trainer.py`` measures this project against, run the way their users run them, on a transformers
CausalLM (the same weights the engine uses) and the same GRPO loss: on-policy, TRL's "dapo" (token-mean)
aggregation for one group, advantages ``(r - mean) / (std + 1e-4)`` (unbiased std), ratio ``exp(l - l.detach())``
clipped at ``1 ± epsilon``.

- ``per_member_sdpa_backward``: what a conventional trainer (TRL's GRPOTrainer) does — the G sequences
  prompt + completion as one batch through ``model(...)`` with transformers' SDPA attention, log-probs of the
  completion tokens only (``logits_to_keep``, as TRL), the loss, one backward. Memory grows with G x context.
- ``prefix_grouper_backward``: the real PrefixGrouper (``prefix-grouper`` on PyPI, the ``bench`` extra), wired as
  its README's "best practices" say: ``PrefixGrouper.from_ungrouped_masks`` -> ``concat_input`` -> one forward with
  ``prefix_grouper=`` through its own transformers hook (``prefix_grouper.utils.register_transformers.
  register_attention``, attention implementation ``"prefix_grouper_attention"``) -> ``split_output(...,
  include_prefix_last=1)`` -> ``convert_padding`` of the completion ids -> the loss -> one backward. Position ids
  restart at the prompt length for every completion, as its docs say. The prompt runs once, under autograd; every
  completion attends to it through a G-fold copy of the prompt's K/V (its ``batch_repeat_cat``). Two ways to split:
  ``split="logits"`` is the README's snippet as written (``split_output`` over ``model(...).logits``, so the LM head
  runs over every prompt position and those logits, their copy and their gradient are held); ``split="hidden"``
  splits the final hidden states instead and runs the LM head on the completions' positions only, as TRL's
  ``logits_to_keep`` does for the per-member graph — the leaner of the two, the baseline the bench's ratios use.

PrefixGrouper's hook hands the attention function it wraps (``prefix_grouper_attn_func``) its 2-D key-padding mask
(``[batch, keys]``, True = token), the mask FlashAttention-2's varlen path takes (bottom-right causal by its own
convention). transformers' ``"sdpa"`` function expects a 4-D mask instead and turns causality off whenever a mask is
given, so ``prefix_grouper_attn_func="sdpa"`` as is either fails to broadcast (G != completion length) or silently
computes NON-causal attention (G == completion length): PrefixGrouper 0.0.1.post1 lists SDPA as future work.
``PG_SDPA`` (registered here) is the few lines such a user writes: it turns that padding mask into what
transformers' own mask code would give SDPA — no mask and ``is_causal`` for the prompt's square, unpadded causal
block (torch's fused flash kernel, GQA native), a bottom-right causal 4-D boolean mask for the completions' block
(prompt keys all visible, own keys causal) — and calls transformers' ``sdpa_attention_forward`` unchanged.
``bench/trainer.py`` checks the resulting gradient against this project's exact mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

ADVANTAGE_EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)
EPSILON = 0.2  # TRL's default clip range
PG_ATTENTION = "prefix_grouper_attention"  # the name PrefixGrouper's register_attention() registers
PG_SDPA = "prefix_grouper_sdpa"  # transformers' SDPA behind PrefixGrouper's 2-D padding mask (see the docstring)
Split = Literal["hidden", "logits"]


def grpo_loss(logp: Tensor, mask: Tensor, rewards: Sequence[float]) -> Tensor:
    """TRL's on-policy GRPO loss for one group, "dapo" aggregation: ``logp`` and ``mask`` are ``[G, T]``."""
    r = torch.as_tensor(rewards, dtype=torch.float32, device=logp.device)
    advantages = ((r - r.mean()) / (r.std() + ADVANTAGE_EPS))[:, None]
    ratio = torch.exp(logp - logp.detach())
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON) * advantages)
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def selective_log_softmax(logits: Tensor, ids: Tensor) -> Tensor:
    """log softmax(logits)[ids] in fp32, one row of the batch at a time (TRL's ``selective_log_softmax``)."""
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])


def pad_right(completions: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``[G, S_max]`` token ids (padded with 0) and their mask (True = token)."""
    width = max(int(c.numel()) for c in completions)
    ids = torch.zeros(len(completions), width, dtype=torch.long)
    mask = torch.zeros(len(completions), width, dtype=torch.bool)
    for row, completion in enumerate(completions):
        ids[row, : completion.numel()] = completion
        mask[row, : completion.numel()] = True
    return ids, mask


@contextlib.contextmanager
def attention_implementation(model: PreTrainedModel, name: str) -> Iterator[None]:
    """Run ``model`` with transformers' attention function ``name``, then restore the one it had."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def per_member_sdpa_backward(model: PreTrainedModel, prompt: Tensor, completions: Sequence[Tensor], rewards) -> float:
    """The conventional trainer's step: G full sequences as one batch through transformers' SDPA, one backward.
    Accumulates into ``param.grad``; returns the loss."""
    ids, mask = pad_right(completions)
    group = len(completions)
    input_ids = torch.cat([prompt.expand(group, -1), ids], dim=1)
    padded = not bool(mask.all())
    attention_mask = (
        torch.cat([torch.ones(group, prompt.numel(), dtype=torch.long), mask.long()], 1) if padded else None
    )
    with attention_implementation(model, "sdpa"):
        # TRL: logits of the last S + 1 positions, the last one dropped (it predicts past the completion)
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=ids.shape[1] + 1, use_cache=False
        ).logits[:, :-1]
        loss = grpo_loss(selective_log_softmax(logits, ids), mask, rewards)
        loss.backward()
    return float(loss.detach())


def prefix_grouper_backward(
    model: PreTrainedModel, prompt: Tensor, completions: Sequence[Tensor], rewards, split: Split = "hidden"
) -> float:
    """The real PrefixGrouper's step for one group (its README's best practices; see the module docstring).
    ``split="logits"``: the README's snippet as written, ``split_output`` over the logits of every position;
    ``split="hidden"``: ``split_output`` over the final hidden states, the LM head then run on the completions'
    positions only (as TRL's ``logits_to_keep``). Accumulates into ``param.grad``; returns the loss."""
    from prefix_grouper import PrefixGrouper

    register_prefix_grouper()
    prompt_ids = prompt[None]
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    completion_ids, completion_mask = pad_right(completions)
    grouper = PrefixGrouper.from_ungrouped_masks(
        prefix_mask=prompt_mask, suffix_mask=completion_mask, group_sizes=len(completions), padding_mode="right"
    )
    input_ids = grouper.concat_input(prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": grouper.padding_mask,
        "position_ids": prefix_grouper_positions(grouper),
        "use_cache": False,
        "prefix_grouper": grouper,
        "prefix_grouper_attn_func": PG_SDPA,
    }
    with attention_implementation(model, PG_ATTENTION):
        if split == "logits":
            _, _, suffix_logits, suffix_mask = grouper.split_output(model(**inputs).logits, include_prefix_last=1)
            suffix_logits = suffix_logits[:, :-1]
        else:
            decoder: nn.Module = model.get_decoder()
            lm_head: nn.Module = model.get_output_embeddings()
            hidden = decoder(**inputs).last_hidden_state
            _, _, suffix_hidden, suffix_mask = grouper.split_output(hidden, include_prefix_last=1)
            suffix_logits = lm_head(suffix_hidden[:, :-1])
        completion_ids = grouper.convert_padding(completion_ids, completion_mask, padding_mode="right")
        loss = grpo_loss(selective_log_softmax(suffix_logits, completion_ids), suffix_mask[:, 1:], rewards)
        loss.backward()
    return float(loss.detach())


def prefix_grouper_positions(grouper) -> Tensor:
    """``[0 .. P-1, P .. P+S_1-1, P .. P+S_2-1, ...]`` per sample, right-padded as ``concat_input`` lays tokens out
    (PrefixGrouper's README, "Position Encoding")."""
    rows = []
    for info in grouper.group_info:
        p = info.prefix_len
        rows.append(torch.cat([torch.arange(p), *(torch.arange(p, p + s) for s in info.suffix_lens)]))
    positions = torch.zeros(grouper.padding_mask.shape, dtype=torch.long)
    for row, (values, mask) in enumerate(zip(rows, grouper.padding_mask, strict=True)):
        positions[row, mask] = values
    return positions


def sdpa_from_padding_mask(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward`` behind PrefixGrouper's ``[batch, keys]`` padding mask: queries are
    the last ``q`` of the keys (bottom-right causal). No mask for an unpadded square block (SDPA's ``is_causal``,
    which transformers turns on only without a mask); otherwise a ``[batch, 1, q, k]`` boolean mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, k_len = query.shape[2], key.shape[2]
    padding = attention_mask.to(device=query.device, dtype=torch.bool)
    if q_len == k_len and bool(padding.all()):
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    rows = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    mask = (torch.arange(k_len, device=query.device)[None, :] <= rows)[None] & padding[:, None, :]
    mask = mask | ~mask.any(-1, keepdim=True)  # padding queries (outputs dropped) attend to all: no NaN rows
    return sdpa_attention_forward(module, query, key, value, mask[:, None], **kwargs)


def register_prefix_grouper() -> None:
    """PrefixGrouper's own transformers hook, and the SDPA adapter its ``prefix_grouper_attn_func`` names."""
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(PG_SDPA, sdpa_from_padding_mask)
