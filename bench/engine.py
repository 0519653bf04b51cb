"""Engine benchmark: per family and model shape, the two costs an agent pays, each side by side with the peer a user
would reach for, and a profile of where the time goes.

- Turn append: an agent episode grows turn by turn (a long opening context, then short turns). The engine extends
  the previous turn's state by the new turn only; the peer is transformers' own incremental forward with a
  ``DynamicCache`` (SDPA attention, as transformers runs by default), over a copy of the opening's cache.
- Capture: evaluating a long context from position 0 (the engine's chunked capture) against transformers' forward
  without a cache, asked for the last position's logits only (``logits_to_keep=1``).

Two model shapes per family (``SHAPES``), each with its own lengths. Every round times, one after the other, the
engine's episode, the DynamicCache episode, the engine's capture and transformers' forward, so that a slow spell of
a shared machine hits all of them alike; a ratio is the median over the rounds of each round's ratio. Then each
contender runs once more under ``torch.profiler`` and its top operators (self CPU time) are printed. State
bytes/token are measured from the states and compared with the analytic figure. Results go to
``bench/results/engine.json``.

    python -m bench.engine [--families llama qwen3_5 glm_moe_dsa] [--shapes base wide] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile
from transformers import PretrainedConfig

from longstraw_agents.engine import Engine, State
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import TINY_PRESETS, build_model, forward_with_cache, returned_cache

RESULTS = Path(__file__).parent / "results"
PROFILE_TOP = 6  # operators listed per contender
TARGET_RATIO = 1.0  # engine / transformers, on both measures


@dataclass(frozen=True)
class Shape:
    """A model shape and the lengths it is timed at. ``head_dim``: None keeps the preset's head sizes."""

    name: str
    hidden: int
    layers: int
    head_dim: int | None
    context: int  # opening context before the first turn
    turn: int  # tokens appended per turn
    turns: int
    capture: int  # tokens of the timed capture
    chunk: int = 512


SHAPES = {
    # the presets' head sizes at hidden 256; the capture re-evaluates the whole episode
    "base": Shape("base", hidden=256, layers=4, head_dim=None, context=2048, turn=64, turns=16, capture=3072),
    # wider heads (head_dim 32) and a fifth layer; shorter turns after a longer opening
    "wide": Shape("wide", hidden=320, layers=5, head_dim=32, context=3000, turn=48, turns=16, capture=4096),
}
QUICK = {"context": 48, "turn": 4, "turns": 4, "capture": 64, "chunk": 16}


def head_sizes(family: str, hidden: int, head_dim: int) -> dict[str, Any]:
    """Config fields that give every attention head ``head_dim`` (and a 5:1 query:KV head ratio where GQA)."""
    heads = hidden // head_dim
    if family == "glm_moe_dsa":
        return {
            "num_attention_heads": heads, "num_key_value_heads": heads, "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim, "kv_lora_rank": 2 * head_dim,
            "q_lora_rank": 3 * head_dim, "index_head_dim": head_dim, "index_n_heads": 4,
        }  # fmt: skip
    sizes: dict[str, Any] = {"num_attention_heads": heads, "num_key_value_heads": heads // 5, "head_dim": head_dim}
    if family == "qwen3_5":
        sizes |= {"linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim}
    return sizes


def bench_config(family: str, shape: Shape) -> PretrainedConfig:
    """The preset at the shape's width and depth (the hybrid keeps its 3:1 linear:full layout), vocabulary 2048;
    DSA selects 256 keys, so it is sparse beyond 256."""
    config = TINY_PRESETS[family](hidden=shape.hidden, layers=shape.layers, vocab_size=2048)
    fields = config.to_dict()
    if shape.head_dim is not None:
        fields |= head_sizes(family, shape.hidden, shape.head_dim)
    if family == "glm_moe_dsa":
        fields["index_topk"] = 256
        for derived in ("qk_head_dim", "head_dim"):  # recomputed from the head sizes
            fields.pop(derived)
    return type(config)(**fields)


@dataclass
class Contenders:
    """The four timed runs of one family and shape."""

    engine: Engine
    model: torch.nn.Module
    opening: State
    opening_cache: Any
    episode: torch.Tensor
    shape: Shape

    def append_episode(self) -> list[float]:
        """Per-turn extend times (s). Each turn appends in place into storage reserved at turn 1 (as the sampler
        does), so every episode from the same opening state is an independent, identical run."""
        shape, state, times = self.shape, self.opening, []
        for t in range(shape.turns):
            lo = shape.context + t * shape.turn
            start = time.perf_counter()
            state = self.engine.extend(state, self.episode[lo : lo + shape.turn], reserve=shape.turns * shape.turn)
            times.append(time.perf_counter() - start)
        return times

    def cache_episode(self) -> list[float]:
        """Per-turn times (s) of transformers' incremental forward over a copy of the opening's cache."""
        shape, cache, times = self.shape, copy.deepcopy(self.opening_cache), []
        with torch.no_grad():
            for t in range(shape.turns):
                lo = shape.context + t * shape.turn
                start = time.perf_counter()
                forward_with_cache(self.model, self.episode[None, lo : lo + shape.turn], cache, use_cache=True)
                times.append(time.perf_counter() - start)
        return times

    def capture(self) -> State:
        return self.engine.capture(self.episode[: self.shape.capture])

    def forward(self) -> None:
        with torch.no_grad():
            self.model(self.episode[None, : self.shape.capture], use_cache=False, logits_to_keep=1)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def top_operators(fn: Callable[[], object], top: int = PROFILE_TOP) -> list[dict[str, Any]]:
    """The ``top`` operators of one run of ``fn`` by self CPU time: name, ms, calls."""
    with profile() as prof:
        fn()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in rows]


def run(family: str, shape: Shape, rounds: int, profiled: bool) -> dict[str, Any]:
    model = build_model(bench_config(family, shape), dtype=torch.float32)
    model.set_attn_implementation("sdpa")  # transformers' default; the engine runs its own attention core
    engine = Engine(model, chunk_size=shape.chunk)
    gen = torch.Generator().manual_seed(0)
    length = max(shape.context + shape.turns * shape.turn, shape.capture)
    episode = torch.randint(0, model.config.vocab_size, (length,), generator=gen)
    opening = engine.capture(episode[: shape.context])
    with torch.no_grad():
        opening_cache = returned_cache(model(episode[None, : shape.context], use_cache=True))
    c = Contenders(engine, model, opening, opening_cache, episode, shape)
    short = Contenders(engine, model, opening, opening_cache, episode, replace(shape, turns=1))
    short.append_episode(), short.cache_episode()  # warm-up: first calls pay one-off set-up

    appends, caches, captures, forwards = [], [], [], []
    for _ in range(rounds):
        appends.append(c.append_episode())
        caches.append(c.cache_episode())
        captures.append(seconds(c.capture))
        forwards.append(seconds(c.forward))
    append_ratio = statistics.median(sum(a) / sum(b) for a, b in zip(appends, caches, strict=True))
    capture_ratio = statistics.median(a / b for a, b in zip(captures, forwards, strict=True))
    append_ms = [statistics.median(r[t] for r in appends) * 1e3 for t in range(shape.turns)]
    cache_ms = [statistics.median(r[t] for r in caches) * 1e3 for t in range(shape.turns)]
    window = max(1, shape.turns // 4)

    captured = c.capture()  # bytes/token between two plain captures (the fixed recurrent bytes cancel)
    measured = (captured.nbytes - opening.nbytes) / (captured.num_tokens - opening.num_tokens)
    analytic = state_size(model.config, torch.float32).bytes_per_token
    result: dict[str, Any] = {
        "shape": {k: v for k, v in vars(shape).items() if k != "name"},
        "append_ms": append_ms,
        "dynamic_cache_ms": cache_ms,
        "append_episode_ms": statistics.median(sum(r) for r in appends) * 1e3,
        "dynamic_cache_episode_ms": statistics.median(sum(r) for r in caches) * 1e3,
        "append_vs_dynamic_cache": append_ratio,
        "flatness": statistics.median(append_ms[-window:]) / statistics.median(append_ms[:window]),
        "capture_ms": statistics.median(captures) * 1e3,
        "transformers_forward_ms": statistics.median(forwards) * 1e3,
        "capture_vs_transformers": capture_ratio,
        "bytes_per_token": measured,
        "bytes_per_token_analytic": analytic,
        "bytes_ratio": measured / analytic,
    }
    if profiled:
        result["profile"] = {
            "append": top_operators(c.append_episode),
            "dynamic_cache": top_operators(c.cache_episode),
            "capture": top_operators(c.capture),
            "transformers_forward": top_operators(c.forward),
        }
    return result


@dataclass
class Table:
    results: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    HEADER = (
        f"{'family':<12} {'shape':<5} {'append ms':>10} {'cache ms':>9} {'append/cache':>12} {'late/early':>10} "
        f"{'capture ms':>10} {'HF fwd ms':>9} {'capture/HF':>10} {'B/token':>8} {'meas/an.':>8}"
    )

    def row(self, family: str, shape: str, r: dict[str, Any]) -> str:
        return (
            f"{family:<12} {shape:<5} {r['append_episode_ms']:>10.1f} {r['dynamic_cache_episode_ms']:>9.1f} "
            f"{r['append_vs_dynamic_cache']:>11.2f}x {r['flatness']:>10.2f} {r['capture_ms']:>10.1f} "
            f"{r['transformers_forward_ms']:>9.1f} {r['capture_vs_transformers']:>9.2f}x "
            f"{r['bytes_per_token']:>8.0f} {r['bytes_ratio']:>8.3f}"
        )


def print_profile(family: str, shape: str, profiles: dict[str, list[dict[str, Any]]]) -> None:
    print(f"{family} / {shape}")
    for contender, ops in profiles.items():
        listed = ", ".join(f"{o['op'].removeprefix('aten::')} {o['ms']:.1f} ({o['calls']})" for o in ops)
        print(f"  {contender:<21} {listed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5", "glm_moe_dsa"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (ratios: median over rounds)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the cores are shared)")
    parser.add_argument("--quick", action="store_true", help=f"toy lengths for a smoke run: {QUICK}")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [replace(SHAPES[name], **QUICK) if args.quick else SHAPES[name] for name in args.shapes]
    print(f"fp32, CPU, {torch.get_num_threads()} thread(s), median of {args.rounds} interleaved rounds")
    for s in shapes:
        heads = "preset head sizes" if s.head_dim is None else f"head_dim {s.head_dim}"
        print(
            f"  {s.name}: {s.layers} layers, hidden {s.hidden}, {heads}; append: {s.turns} turns x {s.turn} tokens "
            f"after {s.context}; capture: {s.capture} tokens in chunks of {s.chunk}"
        )
    print(
        "append: a whole episode of turns (ms) vs transformers' DynamicCache forward (SDPA); capture vs "
        f"transformers' forward without a cache (logits_to_keep=1); target <= {TARGET_RATIO:.1f}x on both"
    )
    table = Table()
    print(table.HEADER)
    print("-" * len(table.HEADER))
    for family in args.families:
        for s in shapes:
            r = run(family, s, args.rounds, args.profile)
            table.results.setdefault(family, {})[s.name] = r
            print(table.row(family, s.name, r), flush=True)
    print("\nappend ms by turn index")
    for family, by_shape in table.results.items():
        for name, r in by_shape.items():
            print(f"{family:<12} {name:<5} " + " ".join(f"{ms:.1f}" for ms in r["append_ms"]))
    if args.profile:
        print(f"\ntop {PROFILE_TOP} operators by self CPU time, one run each: op ms (calls)")
        for family, by_shape in table.results.items():
            for name, r in by_shape.items():
                print_profile(family, name, r["profile"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}  # no machine paths in committed results
    args.out.write_text(json.dumps({"args": settings, "results": table.results}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
