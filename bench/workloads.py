"""What the GPU benchmark measures, and what ``bench.ceilings`` and ``bench.timing`` build on beside it: the three
model families at one size (``FAMILIES``: ``hybrid``, ``dense``, ``mla``), one group's workload (``Workload``),
the work of each phase it times (``score``, ``replay``, ``decode``), the engine it is measured with, and the work the
time model counts for a measured row (``schedules``, ``row_work``).

``bench.gpu`` times the phases, ``bench.ceilings`` micro-benchmarks the rates of a family's profile and
``bench.timing`` sets the two against each other: each imports this module, and this module none of them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import GlmMoeDsaConfig, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config

from bench.gpu_tests import DECODE_GRAPHS_ENV
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.engine.decoding import Decoder, Member
from longstraw_agents.models.presets import build_model, hybrid_layer_types
from longstraw_agents.plan import ModelWork, PlanRequest, Schedule, Work, total
from longstraw_agents.state import State
from longstraw_agents.trainer import LossConfig, backward_group, make_group
from longstraw_agents.trainer.group import Group, completion_members, token_array
from longstraw_agents.trainer.head import Head
from longstraw_agents.trainer.modes import PrefixCache

VOCAB = 32768


@dataclass(frozen=True)
class AttentionShape:
    """One query head per 128 hidden dimensions (at least 2), one KV head per 8 query heads (Qwen3.6's and Qwen3's
    ratios), heads of 128 dimensions."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, hidden: int) -> AttentionShape:
        heads = max(2, hidden // 128)
        return cls(heads, max(1, heads // 8), min(128, hidden // heads * 2))


def attention_model(hidden: int, layers: int, vocab: int) -> dict[str, int | bool]:
    """The settings the hybrid and the dense model share: sizes, attention heads, the MLP, long positions."""
    attention = AttentionShape.of(hidden)
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": attention.heads,
        "num_key_value_heads": attention.kv_heads,
        "head_dim": attention.head_dim,
        "max_position_embeddings": 1 << 22,
        "tie_word_embeddings": False,
    }


def scaled_hybrid(hidden: int, layers: int, vocab: int = VOCAB) -> Qwen3_5TextConfig:
    """The Qwen3.6-27B layout at a size one GPU holds with room for millions of positions of state."""
    attention = AttentionShape.of(hidden)
    linear = min(128, hidden // attention.heads)
    return Qwen3_5TextConfig(
        **attention_model(hidden, layers, vocab),
        linear_num_key_heads=max(1, attention.heads // 2),
        linear_num_value_heads=attention.heads,
        linear_key_head_dim=linear,
        linear_value_head_dim=linear,
        linear_conv_kernel_dim=4,
        layer_types=hybrid_layer_types(layers),
    )


def scaled_dense(hidden: int, layers: int, vocab: int = VOCAB) -> Qwen3Config:
    """A Qwen3 dense model (full attention with q/k norms in every layer) with the hybrid's attention and MLP shapes."""
    return Qwen3Config(**attention_model(hidden, layers, vocab))


def scaled_mla(
    hidden: int, layers: int, vocab: int = VOCAB, experts: int = 8, index_topk: int = 2048
) -> GlmMoeDsaConfig:
    """The GLM-5.2 layout (MLA with GLM's per-head widths, a DSA indexer in every layer, a dense first layer then MoE
    with one shared expert and top-2 routing) at the others' hidden size and depth. The experts are sized so that an
    MoE layer holds as many parameters as the others' MLP, so the model is about as large as they are."""
    heads = AttentionShape.of(hidden).heads
    shared = 1
    return GlmMoeDsaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        moe_intermediate_size=max(16, 3 * hidden // (experts + shared) // 16 * 16),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=shared,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=min(512, hidden // 4),
        q_lora_rank=hidden // 3 // 16 * 16,
        qk_rope_head_dim=min(64, hidden // 16),
        qk_nope_head_dim=min(192, hidden // 8),
        v_head_dim=min(256, hidden // 8),
        index_topk=index_topk,
        index_head_dim=min(128, hidden // 8),
        index_n_heads=max(1, heads // 2),
        first_k_dense_replace=1,
        indexer_types=["full"] * layers,
        max_position_embeddings=1 << 22,
        tie_word_embeddings=False,
    )


FAMILIES: dict[str, Callable[[argparse.Namespace], PretrainedConfig]] = {
    "hybrid": lambda args: scaled_hybrid(args.hidden, args.layers, args.vocab),
    "dense": lambda args: scaled_dense(args.hidden, args.layers, args.vocab),
    "mla": lambda args: scaled_mla(args.hidden, args.layers, args.vocab, args.experts, args.index_topk),
}


@dataclass
class Workload:
    """One group: a prompt of P + 1 tokens, G completions and their rewards, and the tokens decoding is fed."""

    prompt: torch.Tensor
    completions: list[torch.Tensor]
    rewards: list[float]
    decode_tokens: torch.Tensor  # [steps, G]

    @classmethod
    def random(cls, positions: int, args: argparse.Namespace, device: torch.device) -> Workload:
        gen = torch.Generator().manual_seed(positions)
        prompt = torch.randint(0, args.vocab, (positions + 1,), generator=gen).to(device)
        completions = [
            torch.randint(0, args.vocab, (args.completion,), generator=gen).to(device) for _ in range(args.group)
        ]
        rewards = torch.rand(args.group, generator=gen).tolist()
        decode = torch.randint(0, args.vocab, (args.decode_tokens, args.group), generator=gen).to(device)
        return cls(prompt, completions, rewards, decode)

    def group(self) -> Group:
        """The group as ``grpo_backward`` builds it; its root node holds the P shared context tokens."""
        members = completion_members(token_array(self.prompt, "prompt"), self.completions)
        group = make_group(members, self.rewards, LossConfig())
        root = group.tree.root
        if len(root.input_ids) != len(self.prompt) - 1 or len(root.children) != len(self.completions):
            raise ValueError("the completions share first tokens: the group's tree is not one context + G leaves")
        return group


def score(engine: Engine, group: Group, state: State) -> list[torch.Tensor]:
    """Each leaf's target log-probs from the context ``state``, as the trainer computes reference log-probs."""
    head, temperature = Head.of(engine), LossConfig().temperature
    device = engine.adapter.device
    logprobs = []
    with torch.no_grad():
        for leaf in group.tree.root.children:
            hidden = engine.hidden(state, torch.as_tensor(leaf.input_ids, device=device))
            targets = torch.as_tensor(leaf.targets, dtype=torch.long, device=device)
            logprobs.append(head.logprobs(hidden, targets, temperature))
    return logprobs


def replay(engine: Engine, group: Group, state: State) -> None:
    """Detached mode's walk from ``state`` already captured: the branch replays alone."""
    cache = PrefixCache()
    cache.bind(group.tree)
    cache.put(group.tree.root, state, None)
    backward_group(engine, group, "detached", prefix_cache=cache)


def decode(engine: Engine, state: State, tokens: torch.Tensor, graphs: bool | None = None) -> None:
    """``tokens.shape[0]`` batched steps of G members forked from ``state``, then every member leaves.
    ``graphs``: the ``Decoder``'s (None: CUDA graphs on a GPU, unless ``LONGSTRAW_DECODE_GRAPHS=0`` says their
    GPU test failed)."""
    if graphs is None and os.environ.get(DECODE_GRAPHS_ENV, "1") == "0":
        graphs = False
    decoder = Decoder(engine, [Member(state, prefix=state)] * tokens.shape[1], graphs=graphs)
    for step in tokens:
        decoder.step(step)
    decoder.leave(range(tokens.shape[1]))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine every phase is measured with: ``--chunk``, ``--max-score-elements`` and ``--attention``."""
    attention = getattr(args, "attention", "auto")
    return EngineConfig(chunk_size=args.chunk, max_score_elements=args.max_score_elements, attention=attention)


def build(family: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The family's model initialised on ``device`` directly (a 1B-parameter init on the host takes seconds)."""
    with torch.device(device):
        model = build_model(FAMILIES[family](args), dtype=getattr(torch, args.dtype))
    return model.to(device)


# --- the work the time model counts for a measured row ------------------------------------------------------------

STEPS = {  # a measured row's phase -> the time model's phases whose work it does
    "capture": ("capture",),
    "scoring": ("scoring",),
    "replay": ("replay",),
    "decode": ("rollout",),
    "decode_eager": ("rollout",),
    "detached_step": ("capture", "replay"),
    "exact_step": ("capture", "replay", "walk"),
    "walk": ("walk",),
}


def schedules(
    counted: ModelWork, positions: int, args: argparse.Namespace, engine: EngineConfig, **mesh: int
) -> tuple[Schedule, Schedule]:
    """The time model's schedule of a measured step over a context of ``positions`` (the prompt adds the token each
    completion starts from; exact mode, so every phase is there), and of its decoding of ``args.decode_tokens``
    steps. ``counted`` is the model: the request's model name is not read."""
    request = PlanRequest(
        model="measured", context=positions + 1, group=args.group, completion=args.completion,
        gpus=mesh.get("gpus", 1), cp=mesh.get("cp"), dp=mesh.get("dp"), dtype=counted.dtype, engine=engine,
        mode="exact",
    )  # fmt: skip
    return Schedule(request, counted, sharded=False), Schedule(replace(request, completion=args.decode_tokens), counted)


def row_work(row: dict[str, Any], model: ModelWork, args: argparse.Namespace) -> Work:
    """The work the time model counts for a measured row (one process; the prompt is the row's context plus the
    token each completion starts from)."""
    schedule, decoding = schedules(model, row["positions"], args, engine_config(args))
    phases = {
        "capture": schedule.capture,
        "scoring": schedule.scoring,
        "replay": schedule.replay,
        "walk": schedule.walk,
        "rollout": decoding.rollout,
    }
    return total(phases[name]() for name in STEPS[row["phase"]])
