"""Long-context figures on one accelerator: each single-GPU phase of a GRPO step, for three model families (bf16).

Families at the same hidden size and depth, about 1B parameters each: ``hybrid`` (the Qwen3.6-27B layout, 3
GatedDeltaNet : 1 gated attention), ``dense`` (Qwen3: full attention in every layer) and ``mla`` (the GLM-5.2
layout: MLA + DSA + a small MoE). For each family and context length P (the group's shared context: the prompt has
P + 1 tokens, its last one being each completion's first input, as in the trainer's prefix tree), one row per phase:

- ``capture``: ``Engine.capture`` of the P context tokens (no graph);
- ``scoring``: log-probs of the G completions from the captured state, no graph — the trainer's reference log-probs
  (``ExecutionMode.node_loss``: ``Engine.hidden`` from the parent's state, then ``Head.logprobs``), per leaf of the
  group's prefix tree;
- ``replay``: detached mode's branch replays alone (forward + backward of the G completions from the constant
  context state), timed directly: ``backward_group(..., "detached", prefix_cache=...)`` with the cache holding the
  captured state, so the mode extends nothing (``GRPOConfig.capture_reuse``'s path);
- ``decode``: ``Decoder`` steps of the G members sharing the captured prefix, fixed random tokens fed (tokens/s =
  G x steps / s), their states written out at the end as a sampler's ``leave`` does: captured in CUDA graphs
  (its capture included), and as ``decode_eager`` the eager step beside it (``--no-decode-eager``: not);
- at the lengths in ``--exact-at`` only: ``detached_step``, ``grpo_backward(..., "detached")`` (capture +
  replays: on one H200 it came within 1.5 % of their sum at every length, so elsewhere it would only repeat the
  capture), ``exact_step``, ``grpo_backward(..., "exact")`` (the gradient through the whole context), and ``walk``,
  exact_step − detached_step: what the reverse walk through the context adds (a difference, not a measurement: its
  row says so in ``difference_of`` and has no peak).

Each phase is timed with the device synchronised around it, with its peak allocated memory (CUDA; None on CPU).
Each family runs every phase once at two chunks first (decoding two steps), untimed: kernel compilation and
autotuning. Every row also carries the context state's bytes, measured and as ``state_size`` predicts.
``bench/gpu.sh`` runs it on a GPU machine; ``--device cpu --quick`` runs the same code at toy sizes (the suite's
smoke test).

    python -m bench.gpu [--families hybrid dense mla] [--lengths 32768 131072] [--exact-at 32768] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GlmMoeDsaConfig, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config

from longstraw_agents.decoding import Decoder, Member
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import build_model, hybrid_layer_types
from longstraw_agents.state import State
from longstraw_agents.trainer import LossConfig, backward_group, grpo_backward, make_group
from longstraw_agents.trainer.group import Group, completion_members, token_array
from longstraw_agents.trainer.head import Head
from longstraw_agents.trainer.modes import PrefixCache

RESULTS = Path(__file__).parent / "results"
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
class Timing:
    seconds: float = 0.0
    peak: int | None = None


@contextmanager
def clock(device: torch.device) -> Iterator[Timing]:
    """Wall time and peak allocated accelerator memory of a block (the device synchronised around it)."""
    timing = Timing()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    yield timing
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        timing.peak = torch.cuda.max_memory_allocated(device)
    timing.seconds = time.perf_counter() - start


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
    ``graphs``: the ``Decoder``'s (None: CUDA graphs on a GPU)."""
    decoder = Decoder(engine, [Member(state, prefix=state)] * tokens.shape[1], graphs=graphs)
    for step in tokens:
        decoder.step(step)
    decoder.leave(range(tokens.shape[1]))


def decode_rows(
    row: Callable[..., None], timed: Callable[..., Any], engine: Engine, state: State, tokens: torch.Tensor, eager: bool
) -> None:
    """``decode``: the steps over static buffers, captured in CUDA graphs (on CPU run eagerly; the MLA family's run
    eagerly, which the decoder says); with ``eager``, ``decode_eager`` beside it: the eager step, for comparison.
    Each session's captures (one here: no member leaves before the end) are part of its time."""
    row("decode", timed(lambda: decode(engine, state, tokens, graphs=True))[0], tokens.numel())
    if eager:
        row("decode_eager", timed(lambda: decode(engine, state, tokens, graphs=False))[0], tokens.numel())


def measure_phases(
    model: torch.nn.Module,
    engine: Engine,
    positions: int,
    args: argparse.Namespace,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per phase of a GRPO step over a context of ``positions`` tokens (see the module's docstring), each
    also passed to ``on_row`` as soon as it is measured; the family is the engine's (``hybrid``, ``dense``,
    ``mla``)."""
    device = engine.adapter.device
    parameters = sum(p.numel() for p in model.parameters())
    analytic_state = state_size(model.config, engine.adapter.dtype).total(positions)
    work = Workload.random(positions, args, device)
    group = work.group()
    scored = args.group * args.completion
    rows: list[dict[str, Any]] = []
    state_bytes = 0

    def row(phase: str, timing: Timing, tokens: int, difference_of: list[str] | None = None) -> None:
        rows.append(
            {
                "family": engine.family,
                "parameters": parameters,
                "positions": positions,
                "phase": phase,
                "seconds": timing.seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / timing.seconds if timing.seconds > 0 else None,
                "peak_bytes": timing.peak,
                "difference_of": difference_of,
                "state_bytes": state_bytes,
                "state_bytes_analytic": analytic_state,
            }
        )
        if on_row is not None:
            on_row(rows[-1])

    def timed(fn: Callable[[], Any]) -> tuple[Timing, Any]:
        """The median of ``args.repeats`` timings of ``fn()`` (its largest peak) and its last result."""
        timings, result = [], None
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            with clock(device) as timing:
                result = fn()
            timings.append(timing)
        peaks = [t.peak for t in timings if t.peak is not None]
        return Timing(statistics.median(t.seconds for t in timings), max(peaks) if peaks else None), result

    def from_the_context(state: State) -> None:
        """The phases that start from the captured context (its state freed when they are done)."""
        row("scoring", timed(lambda: score(engine, group, state))[0], scored)
        row("replay", timed(lambda: replay(engine, group, state))[0], scored)
        decode_rows(row, timed, engine, state, work.decode_tokens, args.decode_eager)

    with torch.no_grad():
        timing, captured = timed(lambda: engine.capture(work.prompt[:-1]))
    state_bytes = captured.nbytes
    row("capture", timing, positions)
    from_the_context(captured)
    del captured
    if positions not in args.exact_at:
        return rows
    steps = {}
    for mode in ("detached", "exact"):
        timing, _ = timed(lambda mode=mode: grpo_backward(engine, work.prompt, work.completions, work.rewards, mode))
        row(f"{mode}_step", timing, positions + scored)
        steps[mode] = timing.seconds
    model.zero_grad(set_to_none=True)
    row("walk", Timing(steps["exact"] - steps["detached"]), positions, ["exact_step", "detached_step"])
    return rows


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


HEADER = (
    f"{'family':>7} {'params':>7} {'positions':>9} {'phase':>13} {'seconds':>8} {'tokens/s':>10} {'peak GiB':>8} "
    f"{'state MiB':>9} {'meas/an.':>8}"
)


def format_row(r: dict[str, Any]) -> str:
    rate = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
    phase = f"{r['phase']}*" if r["difference_of"] else r["phase"]
    return (
        f"{r['family']:>7} {r['parameters'] / 1e6:>6.1f}M {r['positions']:>9} {phase:>13} {r['seconds']:>8.3f} "
        f"{rate:>10} {gib(r['peak_bytes']):>8} {r['state_bytes'] / 2**20:>9.1f} "
        f"{r['state_bytes'] / r['state_bytes_analytic']:>8.3f}"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine every phase is measured with: ``--chunk`` and ``--max-score-elements``."""
    return EngineConfig(chunk_size=args.chunk, max_score_elements=args.max_score_elements)


def build(family: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The family's model initialised on ``device`` directly (a 1B-parameter init on the host takes seconds)."""
    with torch.device(device):
        model = build_model(FAMILIES[family](args), dtype=getattr(torch, args.dtype))
    return model.to(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_family(family: str, args: argparse.Namespace, device: torch.device) -> tuple[list[dict[str, Any]], dict]:
    """The family's rows at every length, and the seconds its build, warm-up and kernel micro-benchmarks took (not
    part of any row) with the rates those measured (``bench.ceilings``: the time model's profile, per family)."""
    from bench.ceilings import measure_profile  # (it builds on this module's models and phases)

    start = time.perf_counter()
    model = build(family, args, device)
    engine = Engine(model, engine_config(args))
    built = time.perf_counter()
    warm_up = argparse.Namespace(**{**vars(args), "exact_at": [2 * args.chunk], "decode_tokens": 2})
    measure_phases(model, engine, 2 * args.chunk, warm_up)
    warm = time.perf_counter()
    profile = measure_profile(
        family, args, device, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    )
    setup = {"build_s": built - start, "warm_up_s": warm - built, "ceilings_s": time.perf_counter() - warm}
    setup["profile"] = profile.model_dump()
    print(
        f"# {family}: built in {setup['build_s']:.1f} s, warm-up {setup['warm_up_s']:.1f} s, "
        f"micro-benchmarks {setup['ceilings_s']:.1f} s",
        flush=True,
    )
    rows = []
    for positions in args.lengths:
        rows += measure_phases(model, engine, positions, args, on_row=lambda r: print(format_row(r), flush=True))
    del engine, model
    free(device)
    return rows, setup


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "fla": package_version("flash-linear-attention", "fla-core"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["hybrid", "dense", "mla"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 131072], help="context positions")
    parser.add_argument(
        "--exact-at", nargs="*", type=int, default=[32768], help="lengths that also run whole detached and exact steps"
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--experts", type=int, default=8, help="mla: routed experts (top-2)")
    parser.add_argument("--index-topk", type=int, default=2048, help="mla: keys each query attends to (DSA)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--decode-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the eager decode step (decode_eager rows) beside the CUDA-graph one (decode)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timings per phase (the median is reported)")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument(
        "--max-score-elements",
        type=int,
        default=1 << 27,
        help="EngineConfig.max_score_elements: DSA's indexer scores (and eager attention's) per piece",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the smoke test of this script")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.exact_at, args.chunk, args.hidden, args.layers, args.vocab = (
            [128, 256],
            [128],
            64,
            64,
            4,
            1024,
        )
        args.group, args.completion, args.decode_tokens, args.index_topk = 2, 8, 4, 32
    for name in ("lengths", "exact_at"):
        if any(n < 1 for n in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print and write the record (also returned)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}; {args.layers} layers, hidden {args.hidden}, {args.dtype}; chunk {args.chunk}")
    print(f"G={args.group} completions of {args.completion}; {args.decode_tokens} decode steps; {versions()}")
    print("(* a difference of two phases, not a measurement)")
    print(HEADER, flush=True)
    start = time.perf_counter()
    rows, setup = [], {}
    for family in args.families:
        family_rows, setup[family] = run_family(family, args, device)
        rows += family_rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}
    record = {"device": name, "args": settings, "versions": versions(), "setup": setup, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s in all)")
    return record


if __name__ == "__main__":
    main()
