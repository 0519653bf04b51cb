"""Engine benchmark: turn-append cost vs turn index against re-prefilling from scratch, and state bytes/token
measured vs analytic — printed as ratios measured side by side in one run, saved to bench/results/engine.json.

An agent episode grows turn by turn: a long opening context, then per turn an assistant reply and a tool output.
The engine extends the previous turn's state by the new turn only. The peer a user would reach for does the same:
transformers' own incremental forward with a ``DynamicCache`` (SDPA attention, as transformers runs by default) —
timed per turn side by side with the engine's append. Two more baselines re-evaluate the whole episode every turn:
the engine's own chunked capture from position 0 (its fastest prefill), and transformers' full forward.

    python -m bench.engine [--families llama qwen3_5 glm_moe_dsa] [--context 2048] [--turn 64] [--turns 32]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from longstraw_agents.engine import Engine, State
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import TINY_PRESETS, build_model

RESULTS = Path(__file__).parent / "results"


def bench_config(family: str):
    """Small but not toy models: 4 layers, hidden 256 (the hybrid keeps its 3:1 linear:full layout)."""
    overrides = {"hidden": 256, "layers": 4, "vocab_size": 2048}
    if family == "glm_moe_dsa":
        overrides["index_topk"] = 256  # sparse attention active beyond 256 keys
    return TINY_PRESETS[family](**overrides)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def append_times(engine: Engine, opening: State, episode: torch.Tensor, turn: int, turns: int) -> list[float]:
    """One episode's per-turn extend times (s). Each turn appends in place into storage reserved at turn 1 (as the
    sampler does), so each repetition from the same opening state is an independent, identical run."""
    state, times = opening, []
    for t in range(turns):
        lo = opening.num_tokens + t * turn
        start = time.perf_counter()
        state = engine.extend(state, episode[lo : lo + turn], reserve=turns * turn)
        times.append(time.perf_counter() - start)
    return times


def cache_times(model, opening_cache, episode: torch.Tensor, context: int, turn: int, turns: int) -> list[float]:
    """One episode's per-turn times (s) of transformers' incremental forward over a copy of the opening's cache."""
    cache, times = copy.deepcopy(opening_cache), []
    with torch.no_grad():
        for t in range(turns):
            lo = context + t * turn
            start = time.perf_counter()
            model(episode[None, lo : lo + turn], cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return times


def run_family(family: str, context: int, turn: int, turns: int, chunk: int, repeats: int) -> dict:
    model = build_model(bench_config(family), dtype=torch.float32)
    model.set_attn_implementation("sdpa")  # transformers' default; the engine runs its own attention core
    engine = Engine(model, chunk_size=chunk)
    gen = torch.Generator().manual_seed(0)
    episode = torch.randint(0, model.config.vocab_size, (context + turns * turn,), generator=gen)
    opening = engine.capture(episode[:context])
    with torch.no_grad():
        opening_cache = model(episode[None, :context], use_cache=True).cache
    runs, cache_runs = [], []
    for _ in range(repeats):  # interleaved, so that a slow spell of the machine hits both alike
        runs.append(append_times(engine, opening, episode, turn, turns))
        cache_runs.append(cache_times(model, opening_cache, episode, context, turn, turns))
    append_ms = [statistics.median(r[t] for r in runs) * 1e3 for t in range(turns)]
    cache_ms = [statistics.median(r[t] for r in cache_runs) * 1e3 for t in range(turns)]

    probes = sorted({0, turns // 2, turns - 1})  # re-prefill at the first, middle and last turn
    reprefill_ms, hf_ms = {}, {}
    for t in probes:
        ids = episode[: context + (t + 1) * turn]
        reprefill_ms[t + 1] = seconds(lambda ids=ids: engine.capture(ids)) * 1e3
        with torch.no_grad():
            hf_ms[t + 1] = seconds(lambda ids=ids: model(ids[None], use_cache=False)) * 1e3

    # bytes/token from plain captures (reserved storage would count unused capacity)
    final, small = engine.capture(episode), opening
    measured = (final.nbytes - small.nbytes) / (final.num_tokens - small.num_tokens)
    analytic = state_size(model.config, torch.float32).bytes_per_token
    window = max(1, turns // 4)
    first, last = statistics.median(append_ms[:window]), statistics.median(append_ms[-window:])
    cache_last = statistics.median(cache_ms[-window:])
    return {
        "append_ms": append_ms,
        "dynamic_cache_ms": cache_ms,
        "dynamic_cache_last_ms": cache_last,
        "append_vs_dynamic_cache": last / cache_last,
        "append_first_ms": first,
        "append_last_ms": last,
        "flatness": last / first,
        "reprefill_ms": reprefill_ms,
        "transformers_ms": hf_ms,
        "speedup_at_last_turn": reprefill_ms[turns] / append_ms[-1],
        "speedup_vs_transformers_at_last_turn": hf_ms[turns] / append_ms[-1],
        "bytes_per_token": measured,
        "bytes_per_token_analytic": analytic,
        "bytes_ratio": measured / analytic,
        "state_mib": final.nbytes / 2**20,
    }


def print_row(family: str, r: dict, turns: int) -> None:
    print(
        f"{family:<12} {r['append_first_ms']:>9.1f} {r['append_last_ms']:>9.1f} {r['flatness']:>10.2f} "
        f"{r['dynamic_cache_last_ms']:>9.1f} {r['append_vs_dynamic_cache']:>9.2f}x "
        f"{r['reprefill_ms'][turns]:>13.1f} {r['transformers_ms'][turns]:>10.1f} "
        f"{r['speedup_at_last_turn']:>7.1f}x {r['speedup_vs_transformers_at_last_turn']:>7.1f}x "
        f"{r['bytes_per_token']:>8.0f} {r['bytes_ratio']:>8.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5", "glm_moe_dsa"])
    parser.add_argument("--context", type=int, default=2048, help="opening context tokens")
    parser.add_argument("--turn", type=int, default=64, help="tokens appended per turn")
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="episodes timed per family (per-turn median)")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"context {args.context} tokens + {args.turns} turns x {args.turn} tokens, fp32, CPU, chunk {args.chunk}, "
        f"median of {args.repeats} episodes per turn"
    )
    early, late = f"t1-{max(1, args.turns // 4)}", f"t{args.turns - max(1, args.turns // 4) + 1}-{args.turns}"
    header = (
        f"{'family':<12} {early + ' ms':>9} {late + ' ms':>9} {'late/early':>10} {'HF cache':>9} {'vs cache':>10} "
        f"{'re-prefill ms':>13} "
        f"{'HF fwd ms':>10} {'speedup':>8} {'vs HF':>8} {'B/token':>8} {'meas/an.':>8}"
    )
    print(
        "append (median ms over the first and last quarter of the turns) vs transformers' DynamicCache incremental "
        "forward (SDPA) over the last quarter, and vs re-evaluating the whole episode"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for family in args.families:
        results[family] = r = run_family(family, args.context, args.turn, args.turns, args.chunk, args.repeats)
        print_row(family, r, args.turns)
    print("\nappend ms by turn index")
    for family, r in results.items():
        print(f"{family:<12} " + " ".join(f"{ms:.1f}" for ms in r["append_ms"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}  # no machine paths in committed results
    args.out.write_text(json.dumps({"args": settings, "results": results}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
