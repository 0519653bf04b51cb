"""What a device reaches on each class of the time model's work, measured op by op (no phase of a step is used):
the rates of a ``HardwareProfile`` from micro-benchmarks of the kernels the engine calls, at one family's shapes.

- ``matmul``: a layer-shaped ``F.linear`` (a chunk of tokens through an MLP projection);
- ``attention`` / ``attention_backward``: the engine's attention backend on one chunk x chunk block, forward and
  backward (``Attention("auto")``: the fused CPU or CUDA flash kernels);
- ``recurrent`` / ``recurrent_backward``: the delta rule over a chunk as the mixer runs it (its blocks' sequential
  steps included), forward and backward;
- ``selection``: DSA's index scores of a chunk against four chunks of keys and their ``stable_topk``;
- for the MLA family, per op (``dsa_rooflines``: the indexer, the top-k, the sparse attention, the experts), what
  the engine's kernels reach of the run's roofline (its matmul rate and memory bandwidth);
- ``memory``: a matrix-vector product (what a decoding step reads its weights with); ``gathered``: rows gathered at
  random and scattered back (DSA's selected rows);
- the host's latency per layer call on each path (a chunk of a capture, a branch's extend under autograd, a batched
  decoding step): the family's model over a few tokens, less the arithmetic the rates above give it;
- ``elementwise``: what one chunk's capture through the family's real model takes beyond all of the above (its norms,
  rotations, activations, residuals, merges), per element its matmuls write — the one measurement of the model's
  code at full width, over a single chunk (the rows ``bench/timing.py`` checks are longer contexts and other phases).

Each is the median of ``repeats`` timings after one untimed call, synchronised on CUDA. The matmul, memory and host
step rates do not depend on the family: ``bench/gpu.py`` measures them once per run (``SharedRates``) and every
family's profile takes them from there. ``--quick`` (the CPU smoke test) shrinks the memory-bound benchmarks'
sizes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.workloads import FAMILIES, Workload, build, decode, engine_config, replay, schedules
from longstraw_agents.attention import Attention
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.delta_rule import delta_rule, delta_rule_flops
from longstraw_agents.models.mla import stable_topk
from longstraw_agents.plan import Efficiency, HardwareProfile, ModelWork, Work


def seconds(fn: Callable[[], object], device: torch.device, repeats: int = 9) -> float:
    """Median wall time of ``fn()`` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate(hidden: int, chunk: int, dtype: torch.dtype, device: torch.device) -> float:
    x = torch.randn(chunk, hidden, dtype=dtype, device=device)
    w = torch.randn(3 * hidden, hidden, dtype=dtype, device=device)
    return 2 * chunk * hidden * 3 * hidden / seconds(lambda: F.linear(x, w), device)


def attention_rates(
    heads: int,
    kv_heads: int,
    head_dim: int,
    chunk: int,
    dtype: torch.dtype,
    device: torch.device,
    backend_name: str = "auto",
) -> tuple[float, float]:
    """FLOP/s of the engine's attention backend (``backend_name``: ``EngineConfig.attention``) forward and
    backward on one full chunk x chunk block."""
    q = torch.randn(1, heads, chunk, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(1, kv_heads, chunk, head_dim, dtype=dtype, device=device) for _ in range(2))
    backend = Attention(backend_name).kernel(q, k, v)
    scale = head_dim**-0.5
    out, lse = backend.forward(q, k, v, False, scale)
    d_out = torch.randn_like(out)
    flops = 4 * heads * head_dim * chunk * chunk
    forward = seconds(lambda: backend.forward(q, k, v, False, scale), device)
    backward = seconds(lambda: backend.backward(d_out, q, k, v, out, lse, False, scale), device)
    return flops / forward, 2.5 * flops / backward


def delta_rule_rates(config, chunk: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """FLOP/s of the delta rule as the mixer runs it over one chunk, its blocks' sequential steps included: forward
    as a capture runs it (no gradient: fla's fused forward where it works, else the Triton scan on a GPU, the
    pure-torch scan on CPU), and backward (under autograd: the Triton scan's kernels on a GPU; the gradients of its
    inputs and initial state, twice the forward's FLOPs, as the time model counts it)."""
    heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    compute = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype  # the scan's precision

    def made(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, dtype=compute, device=device)).requires_grad_()

    q, k, v = made(chunk, heads, dk), made(chunk, heads, dk), made(chunk, heads, dv)
    g = (-torch.rand(chunk, heads, dtype=compute, device=device)).requires_grad_()
    beta = torch.rand(chunk, heads, dtype=compute, device=device).requires_grad_()
    initial = made(heads, dk, dv, scale=0.1)
    inputs = (q, k, v, g, beta, initial)
    with torch.no_grad():
        forward = seconds(lambda: delta_rule(q, k, v, g, beta, initial), device)
    out, final = delta_rule(*inputs)
    probes = (torch.randn_like(out), torch.randn_like(final))
    backward = seconds(lambda: torch.autograd.grad((out, final), inputs, probes, retain_graph=True), device)
    flops = delta_rule_flops(config, chunk)
    return flops / forward, 2 * flops / backward


def selection_seconds(config, chunk: int, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds per index score: a chunk's scores against four chunks of keys, weighted, and their top-k."""
    heads, dim, keys = config.index_n_heads, config.index_head_dim, 4 * chunk
    q = torch.randn(chunk, heads, dim, dtype=dtype, device=device)
    k = torch.randn(keys, dim, dtype=dtype, device=device)
    w = torch.randn(chunk, heads, dtype=dtype, device=device)

    def select():
        s = F.relu(torch.einsum("nhd,md->nhm", q, k))
        return stable_topk(torch.einsum("nh,nhm->nm", w, s).float(), min(config.index_topk, keys))

    return seconds(select, device) / (chunk * keys)


def memory_rate(dtype: torch.dtype, device: torch.device, megabytes: int = 64) -> float:
    """Bytes/s a decoding step reads weights at: a matrix-vector product over ``megabytes`` of weights."""
    width = 4096
    rows = megabytes * 2**20 // (width * torch.empty((), dtype=dtype).element_size())
    weight = torch.randn(rows, width, dtype=dtype, device=device)
    x = torch.randn(1, width, dtype=dtype, device=device)
    return weight.numel() * weight.element_size() / seconds(lambda: F.linear(x, weight), device)


def gather_seconds(dtype: torch.dtype, device: torch.device, rows: int = 1 << 16, width: int = 576) -> float:
    """Seconds per byte of rows gathered at random (``index_select``) and their gradients scattered back
    (``index_add``), as DSA's selected rows are, counted once."""
    table = torch.randn(rows, width, dtype=dtype, device=device)
    index = torch.randint(0, rows, (rows,), device=device)

    def gather_and_scatter():
        picked = table.index_select(0, index)
        return torch.zeros_like(table).index_add_(0, index, picked)

    return seconds(gather_and_scatter, device) / (2 * rows * width * table.element_size())


def host_step_rate(parameters: int = 1 << 23) -> float:
    """Bytes/s of host memory torch's AdamW steps over (7 fp32 values per parameter: the parameter, its gradient
    and two moments read, three written), on fp32 host tensors as FSDP2's CPU offload keeps them (four of
    ``parameters / 4``: 128 MiB of state, past the caches)."""
    params = [torch.nn.Parameter(torch.randn(parameters // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    optimizer.step()  # its state allocated
    return 7 * 4 * sum(p.numel() for p in params) / seconds(optimizer.step, torch.device("cpu"), repeats=3)


def host_latencies(
    family: str, args: argparse.Namespace, device: torch.device, profile: HardwareProfile
) -> tuple[float, float, float]:
    """Seconds per layer call (or sequential step inside one: a MoE's grouped experts) of a capture's chunk, a branch's
    extend and a decoding step: the family's model at its width over a few tokens, each path's time less what
    ``profile`` gives its arithmetic, over the calls the time model counts for it."""
    few = argparse.Namespace(**{**vars(args), "group": 2, "completion": 2, "decode_tokens": 4, "index_topk": 8})
    chunk, positions = 4, 16
    model = build(family, few, device)
    engine = Engine(model, EngineConfig(chunk_size=chunk))
    work = Workload.random(positions, few, device)
    schedule, decoding = schedules(
        ModelWork.of(model.config, model.dtype), positions, few, EngineConfig(chunk_size=chunk)
    )

    def latency(run: Callable[[], object], modelled: Work, calls: float) -> float:
        return max(seconds(run, device, model_repeats(args)) - profile.time(modelled), 0.0) / calls

    with torch.no_grad():
        state = engine.capture(work.prompt[:-1])
        captured = schedule.capture()
        capture = latency(lambda: engine.capture(work.prompt[:-1]), captured, captured.launches)
    replayed, decoded = schedule.replay(), decoding.rollout()
    branch = latency(lambda: replay(engine, work.group(), state), replayed, replayed.branch_calls)
    step = latency(lambda: decode(engine, state, work.decode_tokens), decoded, decoded.decode_calls)
    return capture, branch, step


def model_repeats(args: argparse.Namespace) -> int:
    """Timings of the benchmarks that run a whole model (host latencies, the elementwise work): fewer under
    ``--quick``, whose figures nobody reads."""
    return 3 if getattr(args, "quick", False) else 9


QUICK_SIZES = {"megabytes": 4, "rows": 1 << 11, "parameters": 1 << 16}  # the memory-bound benchmarks under --quick


@dataclass(frozen=True)
class SharedRates:
    """The rates every family's profile shares (no family's shapes in them): a layer-shaped matmul at the run's width
    and chunk (FLOP/s), a matrix-vector product's weight reads (bytes/s) and AdamW's step over host memory
    (bytes/s)."""

    matmul: float
    memory: float
    host_step: float

    @classmethod
    def measure(cls, args: argparse.Namespace, device: torch.device) -> SharedRates:
        dtype, quick = getattr(torch, args.dtype), getattr(args, "quick", False)
        return cls(
            matmul=matmul_rate(args.hidden, args.chunk, dtype, device),
            memory=memory_rate(dtype, device, QUICK_SIZES["megabytes"]) if quick else memory_rate(dtype, device),
            host_step=host_step_rate(QUICK_SIZES["parameters"]) if quick else host_step_rate(),
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure_profile(
    family: str, args: argparse.Namespace, device: torch.device, name: str, shared: SharedRates | None = None
) -> HardwareProfile:
    """The rates the time model needs, at ``family``'s shapes under ``args`` (its width, chunk, dtype and attention
    backend), the family-independent ones from ``shared`` (measured here when not given). Peaks are set to the
    measured rates themselves (every efficiency is 1): the profile says what was reached. Every rate a step on one
    device uses is measured; the interconnect's (``link_bandwidth``) and the host link's are not (one process moves
    nothing over them)."""
    dtype = getattr(torch, args.dtype)
    config = FAMILIES[family](args)
    shared = shared or SharedRates.measure(args, device)
    peak = shared.matmul
    head_dim = getattr(config, "head_dim", None) or args.hidden // config.num_attention_heads
    if family == "mla":  # absorbed MLA: one KV head whose keys and values are the rows
        heads, kv_heads, head_dim = config.num_attention_heads, 1, config.kv_lora_rank + config.qk_rope_head_dim
    else:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    backend = getattr(args, "attention", "auto")
    forward, backward = attention_rates(heads, kv_heads, head_dim, args.chunk, dtype, device, backend)
    recurrent, recurrent_backward = (
        delta_rule_rates(config, args.chunk, dtype, device) if family == "hybrid" else (peak, peak)
    )
    selection = selection_seconds(config, args.chunk, dtype, device) if family == "mla" else 0.0
    memory = shared.memory
    profile = HardwareProfile(
        name=name, peak_flops=peak, memory_bandwidth=memory, link_bandwidth=1e9, launch_s=0.0, branch_call_s=0.0,
        decode_call_s=0.0, selection_s=selection,
        efficiency=Efficiency(
            matmul=1.0, attention=forward / peak, attention_backward=backward / peak, recurrent=recurrent / peak,
            recurrent_backward=recurrent_backward / peak, memory=1.0, link=1.0,
        ),
        measured_on=f"{name}: micro-benchmarks at the {family} family's shapes (no phase of a step)",
    )  # fmt: skip
    if family == "mla":
        rows = QUICK_SIZES["rows"] if getattr(args, "quick", False) else 1 << 16
        profile = profile.model_copy(update={"gather_s": gather_seconds(dtype, device, rows)})
    capture, branch, decoding = host_latencies(family, args, device, profile)
    profile = profile.model_copy(update={"launch_s": capture, "branch_call_s": branch, "decode_call_s": decoding})
    elementwise = elementwise_seconds(family, args, device, profile)
    return profile.model_copy(update={"elementwise_s": elementwise, "host_step_bandwidth": shared.host_step})


def elementwise_seconds(family: str, args: argparse.Namespace, device: torch.device, profile: HardwareProfile) -> float:
    """Seconds per matmul output element of the work around the matmuls: one chunk's capture through the real
    model, less what ``profile`` gives its matmuls, attention, delta rule, index scores and layer calls."""
    model = build(family, args, device)
    engine = Engine(model, engine_config(args))
    prompt = torch.randint(0, args.vocab, (args.chunk,), device=device)
    with torch.no_grad():
        measured = seconds(lambda: engine.capture(prompt), device, model_repeats(args))
    work = ModelWork.of(model.config, model.dtype).chunked(0, args.chunk, args.chunk, entries_only=True)
    return max(measured - profile.time(work), 0.0) / work.elementwise


def dsa_rooflines(args: argparse.Namespace, device: torch.device, shared: SharedRates) -> dict[str, dict[str, float]]:
    """Per op of the MLA family, at its shapes over one chunk of queries against four chunks of keys, what the
    engine's own kernels reach against the run's roofline (``shared``: its matmul rate and its memory bandwidth):
    ``of_roofline`` = max(FLOPs / matmul rate, bytes / bandwidth) ÷ seconds. The ops: the indexer's scores
    (``DSAIndexer``'s kernel), their top-k (``stable_topk``), the sparse attention over each query's selected rows
    (``sparse_attend``, forward), and the routed experts of one MoE layer (``MoE``'s grouped matmuls)."""
    from longstraw_agents.attention import Attention, sparse_attend
    from longstraw_agents.models.mla import MLAAdapter

    dtype = getattr(torch, args.dtype)
    model = build("mla", args, device)
    adapter = MLAAdapter(model)
    mixer = adapter.layers[0].mixer
    indexer = mixer.indexer
    n, m = args.chunk, 4 * args.chunk
    k = min(model.config.index_topk, m)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, to: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, to)

    size = torch.empty((), dtype=dtype).element_size()
    compute = torch.promote_types(dtype, torch.float32)
    q, w = rand(n, indexer.heads, indexer.dim, to=compute), rand(n, indexer.heads, to=compute)
    keys = rand(m, indexer.dim)
    fast = dtype in (torch.bfloat16, torch.float16)
    scores = indexer._scores(q, w, keys, fast)
    width = mixer.rank + mixer.rope_dim
    rows, own = rand(m, width), rand(n, width)
    queries = rand(n, mixer.heads, width)
    selected = torch.stack([torch.randperm(m + n, generator=gen)[:k] for _ in range(n)]).to(device)
    ops = {
        "indexer": (
            lambda: indexer._scores(q, w, keys, fast),
            2 * n * m * indexer.heads * indexer.dim,
            (n * indexer.heads * indexer.dim + m * indexer.dim) * size + n * m * 4,
        ),
        "top-k": (lambda: stable_topk(scores, k), 0, n * m * 4),
        "sparse attention": (
            lambda: sparse_attend(queries, [rows], [None], own, selected, m, 0.05, attention=Attention()),
            4 * n * k * mixer.heads * width,
            n * k * width * size,
        ),
    }
    experts = _routed_experts(adapter, n, dtype, device, gen)
    if experts is not None:
        ops["experts"] = experts
    found = {}
    with torch.no_grad():
        for name, (run, flops, moved) in ops.items():
            elapsed = seconds(run, device, model_repeats(args))
            floor = max(flops / shared.matmul, moved / shared.memory)
            found[name] = {"seconds": elapsed, "flops": flops, "bytes": moved, "of_roofline": floor / elapsed}
    del model
    return found


def _routed_experts(adapter, n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """The first MoE layer's routed experts over ``n`` tokens: (run, FLOPs, bytes: the experts' weights read once)."""
    from longstraw_agents.models.mla import MoE

    moe = next((layer.mlp for layer in adapter.layers if isinstance(layer.mlp, MoE)), None)
    if moe is None:
        return None
    config = adapter.config
    x = torch.randn(n, config.hidden_size, generator=gen).to(device, dtype)
    top_idx, weights = moe.route(x)
    inter, k = config.moe_intermediate_size, config.num_experts_per_tok
    flops = 2 * 3 * n * k * config.hidden_size * inter
    moved = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    return (lambda: moe.local(x, top_idx, weights), flops, moved)
