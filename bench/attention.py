"""Attention-core benchmark: each backend against the eager oracle, one chunk of queries over long key blocks.

A realistic head shape (head_dim 128, 8 query heads over 2 KV heads: GQA) so that figures are not dominated by
dispatch overhead: a chunk of 512 queries attends causally to itself and to 4K-64K earlier keys (one state block),
in fp32 and bf16. Forward alone (capture/decoding) and forward + backward with the block's gradient sinks (exact
mode's reverse walk) are timed (median of a few runs), with the peak of live tensor bytes (``MemoryTracker``, one
more run). Ratios are to the eager backend at the same shape. Writes ``bench/results/attention.json``.

    python -m bench.attention [--keys 4096 16384 65536] [--dtypes float32 bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from longstraw_agents.attention import BACKENDS, Attention, KVBlock
from longstraw_agents.memory import MemoryTracker

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def case(keys: int, chunk: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q = rand(chunk, HEADS, HEAD_DIM)
    k, v = rand(keys, KV_HEADS, HEAD_DIM), rand(keys, KV_HEADS, HEAD_DIM)
    own_k, own_v = rand(chunk, KV_HEADS, HEAD_DIM), rand(chunk, KV_HEADS, HEAD_DIM)
    return q, k, v, own_k, own_v


def run(attention: Attention, tensors, backward: bool) -> None:
    q, k, v, own_k, own_v = tensors
    scale = HEAD_DIM**-0.5
    if not backward:
        with torch.no_grad():
            attention(q, [KVBlock(k, v)], own_k, own_v, scale)
        return
    leaves = [t.detach().requires_grad_(True) for t in (q, own_k, own_v)]
    block = KVBlock(k, v, torch.zeros_like(k), torch.zeros_like(v))
    attention(leaves[0], [block], leaves[1], leaves[2], scale).sum().backward()


def measure(attention: Attention, tensors, backward: bool, repeats: int) -> tuple[float, int]:
    """(median seconds, peak tracked bytes) of one call."""
    run(attention, tensors, backward)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(attention, tensors, backward)
        times.append(time.perf_counter() - start)
    with MemoryTracker() as tracker:
        run(attention, tensors, backward)
    return statistics.median(times), tracker.peak_bytes


def available(name: str, dtype: torch.dtype) -> bool:
    probe = torch.zeros(1, 2, 1, HEAD_DIM, dtype=dtype)
    return BACKENDS[name].supports(probe, probe, probe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", nargs="+", type=int, default=[4096, 16384, 65536])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS / "attention.json")
    args = parser.parse_args()
    if args.quick:
        args.keys, args.chunk, args.repeats = [256, 1024], 64, 1
    print(
        f"chunk {args.chunk} queries, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, causal own block + "
        f"one earlier block; {torch.get_num_threads()} threads; median of {args.repeats}"
    )
    header = (
        f"{'dtype':<9} {'backend':<10} {'keys':>6} {'fwd ms':>9} {'fwd x':>7} {'fwd+bwd ms':>11} {'f+b x':>7} "
        f"{'peak MiB':>9} {'peak x':>7}"
    )
    print(header)
    print("-" * len(header))
    results: list[dict] = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for keys in args.keys:
            tensors = case(keys, args.chunk, dtype)
            eager = None
            for name in ("eager", *[b for b in BACKENDS if b != "eager"]):
                if not available(name, dtype):
                    continue
                attention = Attention(name)
                fwd, _ = measure(attention, tensors, backward=False, repeats=args.repeats)
                both, peak = measure(attention, tensors, backward=True, repeats=args.repeats)
                row = {"dtype": dtype_name, "backend": name, "keys": keys, "fwd_s": fwd, "fwd_bwd_s": both}
                row["peak_bytes"] = peak
                eager = eager or row
                results.append(row)
                print(
                    f"{dtype_name:<9} {name:<10} {keys:>6} {fwd * 1e3:>9.1f} {eager['fwd_s'] / fwd:>6.2f}x "
                    f"{both * 1e3:>11.1f} {eager['fwd_bwd_s'] / both:>6.2f}x {peak / 2**20:>9.1f} "
                    f"{peak / eager['peak_bytes']:>6.2f}x",
                    flush=True,
                )
    print("x: speed-up over eager (peak: ratio to eager's)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"args": settings, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
