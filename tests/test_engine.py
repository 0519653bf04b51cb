"""Engine: parity with transformers' full forward, immutable forkable states, exact byte accounting, errors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from longstraw_agents.attention import DEFAULT_SCORE_ELEMENTS
from longstraw_agents.engine import Engine, EngineConfig, StateGrad
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import UnsupportedModelError, state_size, supported_model_types
from longstraw_agents.models.presets import tiny_model

FAMILIES = ["llama", "qwen3", "qwen3_5", "glm_moe_dsa"]
VOCAB = 256


def make_model(family: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    # DSA parity with transformers needs index_topk >= context (transformers' own DSA paths disagree otherwise)
    overrides = {"index_topk": 4096} if family == "glm_moe_dsa" else {}
    return tiny_model(family, dtype=dtype, seed=seed, **overrides)


@pytest.fixture(scope="module", params=[(f, d) for f in FAMILIES for d in (torch.float32, torch.float64)])
def model_and_dtype(request):
    family, dtype = request.param
    return family, dtype, make_model(family, dtype)


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["auto", "eager"])
@pytest.mark.parametrize(("prefix_len", "branch_len", "chunk"), [(1, 1, 4), (13, 1, 5), (21, 9, 8), (30, 17, 7)])
def test_logits_match_transformers_full_forward(model_and_dtype, prefix_len, branch_len, chunk, attention):
    _, _, model = model_and_dtype
    ids = random_ids(prefix_len + branch_len, seed=prefix_len)
    ref = reference_logits(model, ids)[prefix_len:]
    engine = Engine(model, EngineConfig(chunk_size=chunk, attention=attention, max_score_elements=40))
    state = engine.capture(ids[:prefix_len])
    with torch.no_grad():
        out = engine.logits(state, ids[prefix_len:])
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5


def test_repeated_extends_match_full_forward(model_and_dtype):
    _, _, model = model_and_dtype
    ids = random_ids(48, seed=7)
    ref = reference_logits(model, ids)
    engine = Engine(model, chunk_size=6)
    state = engine.capture(ids[:11])
    for lo, hi in [(11, 12), (12, 25), (25, 26), (26, 40)]:
        state = engine.extend(state, ids[lo:hi])
        assert state.num_tokens == hi
        with torch.no_grad():
            out = engine.logits(state, ids[hi:])
        assert rel_err(out, ref[hi:]) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_state_entries_without_hidden_states_equal_the_forwards(family):
    # DSA selecting fewer keys than the context: the last layer's skipped selection must not change its entries
    model = tiny_model(family, dtype=torch.float32, **({"index_topk": 3} if family == "glm_moe_dsa" else {}))
    engine = Engine(model, chunk_size=5)
    state = engine.capture(random_ids(12, 3))
    ids = random_ids(7, 4)
    with torch.no_grad():
        contexts = engine.kit.contexts(state, len(state.chunks), None)
        _, expected = engine.kit.forward(ids, state.num_tokens, contexts)
        entries = engine.kit.state_entries(ids, state.num_tokens, contexts)
    assert len(entries) == len(expected) == len(engine.adapter.layers)
    for got, want in zip(entries, expected, strict=True):
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_logits_twice_identical_and_parent_unchanged_by_forks(model_and_dtype):
    _, _, model = model_and_dtype
    engine = Engine(model, chunk_size=5)
    prefix, branch = random_ids(17, 1), random_ids(6, 2)
    parent = engine.capture(prefix)
    with torch.no_grad():
        first = engine.logits(parent, branch)
        assert torch.equal(first, engine.logits(parent, branch))
        children = [engine.extend(parent, random_ids(n, 10 + n)) for n in (1, 4, 9)]
        grandchild = engine.extend(children[1], random_ids(3, 99))
        assert torch.equal(first, engine.logits(parent, branch))
    assert parent.num_tokens == 17
    assert [c.num_tokens for c in children] == [18, 21, 26] and grandchild.num_tokens == 24


def test_children_share_parent_storage(model_and_dtype):
    family, dtype, model = model_and_dtype
    engine = Engine(model, chunk_size=8)
    parent = engine.capture(random_ids(20, 3))
    child = engine.extend(parent, random_ids(5, 4))
    size = state_size(model.config, dtype)
    for layer in range(engine.num_layers):
        parent_blocks, child_blocks = parent.blocks(layer), child.blocks(layer)
        for pb, cb in zip(parent_blocks, child_blocks, strict=False):
            assert pb.arena is cb.arena  # the child references the parent's tensors, nothing copied
    parent_arenas = {id(b.arena) for layer in range(engine.num_layers) for b in parent.blocks(layer)}
    new_bytes = sum(
        b.arena.nbytes
        for layer in range(engine.num_layers)
        for b in child.blocks(layer)
        if id(b.arena) not in parent_arenas
    )
    assert new_bytes == 5 * size.bytes_per_token


def snapshots(num_chunks: int, spacing: int) -> int:
    """Recurrent states a state of ``num_chunks`` chunks keeps: every ``spacing``-th one before the last, and the
    last."""
    return 1 + (sum(1 for j in range(num_chunks - 1) if (j + 1) % spacing == 0) if spacing else 0)


@pytest.mark.parametrize("checkpoints", [False, True, 1, 2])
def test_nbytes_equals_analytic_size(model_and_dtype, checkpoints):
    _, dtype, model = model_and_dtype
    engine = Engine(model, chunk_size=8)
    size = state_size(model.config, dtype)
    state = engine.capture(random_ids(37, 5), checkpoints=checkpoints)  # 5 chunks
    spacing = state.checkpoints
    assert spacing == (engine.checkpoint_spacing if checkpoints is True else int(checkpoints))
    assert state.nbytes == size.total(37, snapshots(5, spacing))
    assert state.checkpoint_nbytes == size.fixed_bytes * (snapshots(5, spacing) - 1)
    child = engine.extend(state, random_ids(3, 6))
    assert child.nbytes == size.total(40, snapshots(6, spacing))


def test_the_default_checkpoint_spacing_keeps_checkpoints_within_the_attention_state():
    """k is the smallest spacing whose checkpoints take no more memory per token than the attention state."""
    from longstraw_agents.models.presets import qwen3_6_27b_like

    tiny = Engine(make_model("qwen3_5", torch.float32), chunk_size=8)
    size = state_size(tiny.model.config, torch.float32)
    k = tiny.checkpoint_spacing
    assert size.fixed_bytes / k <= size.bytes_per_token * 8 < size.fixed_bytes / max(k - 1, 1e-9)
    assert Engine(make_model("llama", torch.float32)).checkpoint_spacing == 1  # nothing recurrent to space out
    big = state_size(qwen3_6_27b_like(), torch.bfloat16)  # 147 MiB of recurrent state, 64 KiB per token
    assert math.ceil(big.fixed_bytes / (big.bytes_per_token * 512)) == 5


def test_only_attention_layers_grow_per_token():
    model = make_model("qwen3_5", torch.float32)
    engine = Engine(model, chunk_size=16)
    cfg = model.config
    small, large = engine.capture(random_ids(10, 1)), engine.capture(random_ids(110, 1))
    per_token = (large.nbytes - small.nbytes) / 100
    attn_layers = cfg.layer_types.count("full_attention")
    assert per_token == attn_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    for i in linear:
        assert small.recurrent(i).nbytes == large.recurrent(i).nbytes > 0


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_analytic_bytes_per_token_full_size_meta_configs():
    """The planner's figures, checked against the modules' own shapes on meta-device models."""
    from longstraw_agents.models.presets import glm_5_2_like, qwen3_6_27b_like

    qwen = qwen3_6_27b_like()
    model = meta_model(qwen)
    expected_per_token = 0
    expected_fixed = 0
    for layer in model.model.layers:
        if layer.block_type == "full_attention":
            expected_per_token += 2 * layer.self_attn.k_proj.out_features * 2  # K and V, bf16
        else:
            gdn = layer.linear_attn
            conv = gdn.conv1d.weight.shape[0] * (gdn.conv1d.weight.shape[-1] - 1) * 2
            expected_fixed += conv + gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim * 4  # state kept in fp32
    size = state_size(qwen, torch.bfloat16)
    assert (size.bytes_per_token, size.fixed_bytes) == (expected_per_token, expected_fixed)
    assert size.bytes_per_token == 16 * 2 * 4 * 256 * 2  # 16 attention layers x K,V x 4 heads x 256 x bf16

    glm = glm_5_2_like()
    model = meta_model(glm)
    expected = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        expected += (attn.kv_lora_rank + attn.qk_rope_head_dim) * 2
        if attn.indexer is not None:
            expected += attn.indexer.head_dim * 2
    size = state_size(glm, torch.bfloat16)
    assert size.bytes_per_token == expected and size.fixed_bytes == 0


def test_capture_peak_is_state_plus_one_chunk():
    """Capture holds the state and one chunk's activations: the overhead over the final state does not grow with
    the prefix once a chunk's keys are split into bounded pieces."""
    model = make_model("llama", torch.float32)
    engine = Engine(model, EngineConfig(chunk_size=16, max_score_elements=16 * 16 * 2))
    overheads = []
    for length in (64, 512):
        ids = random_ids(length, 0)
        with MemoryTracker() as mem:
            state = engine.capture(ids)
        overheads.append(mem.peak_bytes - state.nbytes)
    assert overheads[1] <= 1.05 * overheads[0]


def test_step_returns_next_token_logits_and_child():
    model = make_model("qwen3_5", torch.float64)
    engine = Engine(model, chunk_size=4)
    ids = random_ids(15, 8)
    state = engine.capture(ids[:10])
    child, last = engine.step(state, ids[10:15])
    ref = reference_logits(model, ids)[-1]
    assert child.num_tokens == 15
    assert rel_err(last, ref) < 1e-5


def test_decoding_with_reserve_appends_in_place_and_siblings_stay_valid():
    model = make_model("llama", torch.float64)
    engine = Engine(model, chunk_size=8)
    ids = random_ids(30, 9)
    state = engine.capture(ids[:10])
    state = engine.extend(state, ids[10:11], reserve=16)
    fork_point = state
    for t in range(11, 20):
        state = engine.extend(state, ids[t : t + 1], reserve=16)
    assert len(state.blocks(0)) == 2  # the captured prefix + one arena holding all decoded tokens
    sibling = engine.extend(fork_point, random_ids(3, 77), reserve=16)  # fork_point's arena is taken: fresh one
    assert sibling.blocks(0)[-1].arena is not state.blocks(0)[-1].arena
    with torch.no_grad():  # against the engine's own one-pass forward: fp64 exact (transformers casts to fp32)
        full = engine.logits(engine.empty_state(), ids)
        assert rel_err(engine.logits(state, ids[20:]), full[20:]) < 1e-12
        sib_ids = torch.cat([ids[:11], random_ids(3, 77), ids[20:]])
        sib_full = engine.logits(engine.empty_state(), sib_ids)
        assert rel_err(engine.logits(sibling, ids[20:]), sib_full[14:]) < 1e-12


def test_unsupported_model_names_supported_families():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(UnsupportedModelError) as err:
        Engine(gpt2)
    message = str(err.value)
    assert "gpt2" in message
    for family in ("dense", "hybrid", "mla"):
        assert family in message
    with pytest.raises(UnsupportedModelError):
        Engine(torch.nn.Linear(2, 2))
    assert supported_model_types()["glm_moe_dsa"] == "mla"


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (torch.tensor([], dtype=torch.long), ValueError),
        (torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([[1, 2]]), ValueError),
        (torch.tensor([1, VOCAB]), ValueError),
        (torch.tensor([-1, 2]), ValueError),
        ("not ids", TypeError),
        ([], ValueError),
        ([1.5, 2.0], TypeError),  # a list of floats is refused, not truncated to token ids
        ([True, False], TypeError),
    ],
)
def test_bad_ids_get_clear_errors(ids, error):
    engine = Engine(make_model("llama", torch.float32))
    with pytest.raises(error):
        engine.capture(ids)
    state = engine.capture(torch.tensor([1, 2, 3]))
    with pytest.raises(error):
        engine.logits(state, ids)


def test_state_from_another_model_is_rejected():
    a, b = Engine(make_model("llama", torch.float32)), Engine(make_model("llama", torch.float32, seed=1))
    state = a.capture(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="different model"):
        b.logits(state, torch.tensor([4]))
    with pytest.raises(TypeError):
        a.logits("state", torch.tensor([4]))


def test_engine_config_validation():
    with pytest.raises(ValueError):
        EngineConfig(chunk_size=0)
    assert Engine(make_model("llama", torch.float32), chunk_size=3).config.chunk_size == 3


@pytest.mark.parametrize(
    ("max_score_elements", "checkpoint_every"),
    [(DEFAULT_SCORE_ELEMENTS, 1), (1, 1), (DEFAULT_SCORE_ELEMENTS, 2), (DEFAULT_SCORE_ELEMENTS, 5)],
    ids=["one-gradient-piece", "chunk-sized-gradient-pieces", "checkpoint-every-2", "checkpoint-every-5"],
)
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "glm_moe_dsa"])
def test_a_reserved_chain_is_one_block_and_its_exact_gradient_equals_the_full_graph(
    family, max_score_elements, checkpoint_every
):
    """Extends of a chain into reserved storage land contiguous in one arena: attention reads one block (in the
    graph-free path, and with its gradient added in one piece or chunk-sized pieces when the budget is small),
    blocks before a chunk are clipped views of it, and the exact backward walk through it gives the full-graph
    gradient — also when recurrent states are kept only every k chunks and recomputed in between."""
    model = tiny_model(family, dtype=torch.float64, seed=0)  # glm: index_topk < context, sparse selection on
    config = EngineConfig(chunk_size=4, max_score_elements=max_score_elements, checkpoint_every=checkpoint_every)
    engine = Engine(model, config)
    ids, branch = random_ids(23, 21), random_ids(5, 22)
    cuts = [0, 6, 7, 8, 15, 16, 23]  # first extend: two chunks; then single tokens and a multi-chunk extend
    state = engine.empty_state(checkpoints=True)
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        state = engine.extend(state, ids[lo:hi], reserve=23 - hi if lo == 0 else 0)
    growing = [i for i, layer in enumerate(engine.adapter.layers) if layer.mixer.grows]
    for i in growing:
        assert len(state.blocks(i)) == 1 and state.blocks(i)[0].length == 23
        for j, chunk in enumerate(state.chunks):
            assert sum(b.length for b in state.blocks(i, j)) == chunk.start

    weights = torch.randn(5, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    full = engine.logits(engine.empty_state(), torch.cat([ids, branch]))[23:]
    (full * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    grad = StateGrad()
    (engine.logits(state, branch, grad=grad) * weights).sum().backward()
    engine.backward(state, grad, ids)
    # the DSA indexer gets exact zeros here where the full graph leaves None (its keys feed no differentiable path)
    actual = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and (p.grad != 0).any()}
    assert actual.keys() == expected.keys()
    diff = sum(float((actual[n] - expected[n]).norm() ** 2) for n in expected) ** 0.5
    assert diff <= 1e-9 * sum(float(g.norm() ** 2) for g in expected.values()) ** 0.5


def test_gradient_buckets_keep_order_and_hold_a_larger_tensor_alone():
    from longstraw_agents.engine.wavefront import _buckets

    tensors = [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)]  # 40, 40, 120, 20, 20, 20 bytes
    buckets = _buckets(tensors, limit=80)
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [30], [5, 5, 5]]
    assert [t for b in buckets for t in b] == tensors and _buckets([], 80) == []


def test_message_tags_are_unique_across_kinds_and_refuse_what_they_cannot_hold():
    """A sharded capture's and the wavefront walk's messages share a transport (gloo matches by tag): no two kinds,
    runs or layers may share a tag, and a schedule too large for the fields is refused before it sends anything."""
    from longstraw_agents.engine.tags import MAX_LAYERS, MAX_RUNS, MessageKind, check_tag_bounds, message_tag

    cells = [(0, 0), (1, 0), (0, 1), (MAX_RUNS - 1, MAX_LAYERS - 1), (MAX_RUNS - 1, 0), (0, MAX_LAYERS - 1)]
    tags = [message_tag(kind, run, layer) for kind in MessageKind for run, layer in cells]
    assert len(set(tags)) == len(tags) and 0 < min(tags) and max(tags) < 2**31
    check_tag_bounds(MAX_RUNS, MAX_LAYERS)
    for runs, layers in ((MAX_RUNS + 1, 4), (4, MAX_LAYERS + 1)):
        with pytest.raises(ValueError, match="message tags hold at most"):
            check_tag_bounds(runs, layers)
    for run, layer in ((MAX_RUNS, 0), (0, MAX_LAYERS), (-1, 0)):
        with pytest.raises(ValueError, match="a message tag holds"):
            message_tag(MessageKind.WALK_ROWS, run, layer)


def test_the_schedules_refuse_more_runs_than_the_tags_hold_before_sending(monkeypatch):
    """A sharded capture and the wavefront walk check their runs and layers against the tags' fields as they are
    built (on every rank alike, before a message is sent): here fields narrowed below the schedule's sizes."""
    from dataclasses import dataclass

    from longstraw_agents.engine import LayerInputs, tags
    from longstraw_agents.engine.sharded_capture import ShardedCapture
    from longstraw_agents.engine.wavefront import WavefrontWalk
    from longstraw_agents.parallel import BalancedOwnership

    @dataclass
    class OneRanksView:  # what an engine over 2 ranks holds; neither schedule gets as far as its transport
        ownership: BalancedOwnership
        transport: None = None

    model = tiny_model("llama", dtype=torch.float64)
    shards = OneRanksView(BalancedOwnership(0, 2))
    engine = Engine(model, EngineConfig(chunk_size=4), shards=shards)  # type: ignore[arg-type]
    monkeypatch.setattr(tags, "MAX_RUNS", 2)  # a balanced cut over 2 ranks makes 3 runs: rank 0's, 1's, 0's
    with pytest.raises(ValueError, match="this schedule has 3 runs over 2 layers"):
        ShardedCapture(engine.kit, shards, engine.empty_state(), torch.arange(16), 4)  # type: ignore[arg-type]
    state = Engine(model, EngineConfig(chunk_size=4)).capture(torch.arange(16))
    walked = state.with_layer_inputs(LayerInputs.empty(torch.device("cpu"), 1, 0))
    monkeypatch.setattr(tags, "MAX_RUNS", 4)
    monkeypatch.setattr(tags, "MAX_LAYERS", 1)  # (the one process's chunks: one run)
    with pytest.raises(ValueError, match="this schedule has 1 runs over 2 layers"):
        WavefrontWalk(engine.kit, shards, walked, engine.new_grad(), torch.arange(16), None)  # type: ignore[arg-type]
