"""GLM-MoE-DSA (MLA + DeepSeek sparse attention + MoE) against a reference written from the definition.

``tests/reference_dsa.py`` is validated against transformers where transformers is right (``index_topk`` >=
context, and, with its top-k made tie-stable, everywhere); the engine is then tested against the reference with
real sparse selections, for causal consistency, and for actually being sparse.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from reference_dsa import (
    causal_visibility,
    index_scores,
    reference_logits,
    relative_error,
    rope_interleaved,
    select_keys,
)
from torch import Tensor, nn

import longstraw_agents.models.mla as mla
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.mla import BestKeys, stable_topk
from longstraw_agents.models.presets import forward_with_cache, returned_cache, tiny_model

DTYPES = [torch.float32, torch.float64]
# relative tolerance of engine vs reference: both compute in the model's dtype (wide parts in max(dtype, fp32))
ENGINE_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
# relative tolerance of reference vs transformers: transformers runs norms, router, indexer, softmax and the rotary
# angles in fp32 even for fp64 models, so fp64 agreement bottoms out near 1e-7
TRANSFORMERS_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
DENSE_TOPK = 128  # >= every context used here: DSA selects every visible key


@functools.cache
def model(dtype: torch.dtype, index_topk: int, seed: int = 0) -> nn.Module:
    """A tiny random-init GLM-MoE-DSA (layers: full indexer + dense MLP, shared indexer + MoE, full + MoE).

    The weights depend on the seed only, not on ``index_topk``, so two topk values give the same network.
    """
    return tiny_model("glm_moe_dsa", dtype=dtype, seed=seed, index_topk=index_topk)


def token_ids(n: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def engine_logits(engine: Engine, ids: Tensor, segments: list[int]) -> Tensor:
    """Logits of the last segment after capturing the first and extending by the ones between."""
    bounds = torch.tensor(segments).cumsum(0).tolist()
    state = engine.capture(ids[: bounds[0]])
    for start, end in zip(bounds[:-2], bounds[1:-1], strict=True):
        state = engine.extend(state, ids[start:end])
    return engine.logits(state, ids[bounds[-2] :])


def selected_scores(scores: Tensor, selected: Tensor, topk: int) -> Tensor:
    """Each row's selected scores, best first (``[n, topk]``, -inf padded): the selection up to tie-breaking."""
    return scores.masked_fill(~selected, float("-inf")).sort(dim=-1, descending=True).values[:, :topk]


@pytest.fixture
def tie_stable_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``Tensor.topk`` break ties towards the lower index (a stable sort), as the DSA definition does.

    transformers' indexer selects with ``index_scores.topk``; its router also calls ``.topk``, but on continuous
    scores without ties, where the chosen set is the same whatever the tie rule.
    """

    def stable_topk(self: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, order), order))

    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)


# --- the reference against transformers --------------------------------------------------------------------------
def test_interleaved_rope_rotates_adjacent_pairs() -> None:
    """Pair (x_{2i}, x_{2i+1}) rotates by angle θ_i; the output lists the rotated evens, then the rotated odds."""
    theta = [0.3, -1.1]
    angles = torch.tensor([theta + theta], dtype=torch.float64)  # cat(freqs, freqs), as the rotary embedding gives
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=torch.float64)
    (e0, o0), (e1, o1) = (
        (a * math.cos(t) - b * math.sin(t), b * math.cos(t) + a * math.sin(t))
        for (a, b), t in zip([(1.0, 2.0), (3.0, 4.0)], theta, strict=True)
    )
    expected = torch.tensor([e0, e1, o0, o1], dtype=torch.float64)
    torch.testing.assert_close(rope_interleaved(x, angles.cos(), angles.sin())[0, 0], expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_transformers_when_topk_covers_context(dtype: torch.dtype) -> None:
    net, ids = model(dtype, DENSE_TOPK), token_ids(48)
    with torch.no_grad():
        assert relative_error(reference_logits(net, ids), net(ids[None]).logits[0]) < TRANSFORMERS_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_indexer_selects_what_transformers_indexer_selects_up_to_ties(dtype: torch.dtype) -> None:
    """On every full-indexer layer and random inputs: the selected scores agree row by row (as multisets), and
    the selected keys agree exactly on rows where no tie straddles the top-k cut."""
    topk, n = 4, 40
    net = model(dtype, topk)
    gen = torch.Generator().manual_seed(0)
    cos, sin = (t[0] for t in net.model.rotary_emb(torch.zeros(1, n, dtype=dtype), torch.arange(n)[None]))
    additive_causal = torch.full((1, n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)
    indexers = [layer.self_attn.indexer for layer in net.model.layers if layer.self_attn.indexer is not None]
    assert len(indexers) == 2
    for indexer in indexers:
        x = torch.randn(n, net.config.hidden_size, generator=gen, dtype=dtype)
        q_resid = torch.randn(n, net.config.q_lora_rank, generator=gen, dtype=dtype)
        with torch.no_grad():
            scores = index_scores(indexer, x, q_resid, cos, sin)
            theirs = indexer(x[None], q_resid[None], (cos[None], sin[None]), additive_causal, None)[0].long()
        ours = select_keys(scores, topk)
        theirs = torch.zeros_like(ours).scatter_(1, theirs, True) & causal_visibility(n, x.device)
        torch.testing.assert_close(selected_scores(scores, ours, topk), selected_scores(scores, theirs, topk))
        ranked = scores.sort(dim=-1, descending=True).values
        clean_cut = ranked[topk:, topk - 1] > ranked[topk:, topk]  # rows that see more than topk keys
        assert clean_cut.any()
        assert torch.equal(ours[topk:][clean_cut], theirs[topk:][clean_cut])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_tie_stable_transformers_with_sparse_selection(
    dtype: torch.dtype, tie_stable_topk: None
) -> None:
    """With ``index_topk`` < context transformers disagrees with the reference only through ``topk``'s tie rule
    among the many exactly-zero index scores (relu): made tie-stable, its full and cached forwards both agree."""
    net, ids, split = model(dtype, 4), token_ids(56, seed=1), 21
    with torch.no_grad():
        reference = reference_logits(net, ids)
        full = net(ids[None]).logits[0]
        prefix = net(ids[None, :split], use_cache=True)
        cached = forward_with_cache(net, ids[None, split:], returned_cache(prefix)).logits[0]
    assert relative_error(reference, full) < TRANSFORMERS_TOL[dtype]
    assert relative_error(reference[split:], cached) < TRANSFORMERS_TOL[dtype]


def test_transformers_forward_is_not_causally_consistent_with_sparse_selection() -> None:
    """Documents an upstream fact of transformers 5.24, not a property of this project.

    With ``index_topk`` < context, transformers' full forward of a sequence and of its first 40 tokens give
    different logits at those 40 positions: ``Tensor.topk`` breaks ties among the exactly-zero index scores
    differently as the rows grow. (That is why the engine is tested against ``reference_dsa``.) If this test starts
    failing, transformers has fixed its tie-breaking and engine parity can be tested against it directly.
    """
    net, ids = model(torch.float64, 4), token_ids(64)
    with torch.no_grad():
        appended = net(ids[None]).logits[0, :40]
        alone = net(ids[None, :40]).logits[0]
    assert relative_error(appended, alone) > 0.01
    assert relative_error(reference_logits(net, ids)[:40], reference_logits(net, ids[:40])) < 1e-12


# --- the engine against the reference ----------------------------------------------------------------------------
SPLITS = [
    pytest.param(4, [23, 37], id="topk4-prefix23-branch37"),
    pytest.param(4, [47, 1], id="topk4-branch1"),
    pytest.param(8, [3, 61], id="topk8-prefix-below-topk"),
    pytest.param(8, [8, 52], id="topk8-prefix-equals-topk"),
    pytest.param(8, [32, 38], id="topk8-prefix-multiple-of-chunk"),
    pytest.param(4, [17, 9, 1, 13, 21], id="topk4-repeated-extends"),
    pytest.param(8, [5, 6, 30, 1], id="topk8-repeated-extends-branch1"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("topk", "segments"), SPLITS)
def test_engine_matches_reference_with_sparse_selection(dtype: torch.dtype, topk: int, segments: list[int]) -> None:
    net = model(dtype, topk)
    ids = token_ids(sum(segments), seed=len(segments))
    with torch.no_grad():
        expected = reference_logits(net, ids)[sum(segments[:-1]) :]
        actual = engine_logits(Engine(net, chunk_size=16), ids, segments)
    assert relative_error(actual, expected) < ENGINE_TOL[dtype]


def test_engine_logits_do_not_depend_on_split_or_chunk_size() -> None:
    """Positions 40..63 under several prefix/branch splits and chunk sizes: the same logits to fp64 precision."""
    net, ids, first = model(torch.float64, 4), token_ids(64, seed=2), 40
    runs = [(16, [40, 24]), (7, [40, 24]), (1, [40, 24]), (5, [33, 31]), (16, [10, 30, 24]), (9, [2, 11, 27, 24])]
    with torch.no_grad():
        per_run = [
            engine_logits(Engine(net, chunk_size=chunk), ids, segments)[first - sum(segments[:-1]) :]
            for chunk, segments in runs
        ]
    for logits in per_run[1:]:
        assert relative_error(logits, per_run[0]) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
def test_appending_tokens_never_changes_earlier_logits(dtype: torch.dtype) -> None:
    net, ids = model(dtype, 4), token_ids(64, seed=3)
    tol = 1e-12 if dtype == torch.float64 else ENGINE_TOL[dtype]
    engine = Engine(net, chunk_size=16)
    with torch.no_grad():
        full_reference = reference_logits(net, ids)
        state = engine.capture(ids[:20])
        full_branch = engine.logits(state, ids[20:])
        for end in (5, 21, 37, 63):
            assert relative_error(reference_logits(net, ids[:end]), full_reference[:end]) < tol
        for end in (21, 33, 50):
            assert relative_error(engine.logits(state, ids[20:end]), full_branch[: end - 20]) < tol


@pytest.mark.parametrize("topk", [4, 8])
def test_engine_selection_is_sparse(topk: int) -> None:
    """The same weights with topk >= context: logits agree while a query sees <= topk keys, and every later
    position differs clearly — an engine that attended to every key would fail here."""
    sparse, dense = model(torch.float64, topk), model(torch.float64, DENSE_TOPK)
    assert all(torch.equal(a, b) for a, b in zip(sparse.parameters(), dense.parameters(), strict=True))
    ids, split = token_ids(56, seed=4), 20
    with torch.no_grad():
        sparse_logits = engine_logits(Engine(sparse, chunk_size=16), ids, [split, 56 - split])
        dense_logits = engine_logits(Engine(dense, chunk_size=16), ids, [split, 56 - split])
        sparse_prefix = engine_logits(Engine(sparse, chunk_size=16), ids[:topk], [1, topk - 1])
        dense_prefix = engine_logits(Engine(dense, chunk_size=16), ids[:topk], [1, topk - 1])
    assert relative_error(sparse_prefix, dense_prefix) < ENGINE_TOL[torch.float64]
    per_position = (sparse_logits - dense_logits).abs().amax(-1) / dense_logits.abs().amax(-1)
    assert per_position.min() > 1e-2


# --- the selection: top-k by score, ties to the earlier position -------------------------------------------------
def sort_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The definition: a stable descending sort of each whole row, cut to ``k``."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, order), order


def merge_by_sort(running: tuple[Tensor, Tensor] | None, scores: Tensor, positions: Tensor, k: int):
    """The best ``k`` (score, position) after one more piece of keys, by a stable sort of the running best followed
    by the piece (what the selection computed piece by piece before it reduced pieces in groups)."""
    pos = positions.unsqueeze(0).expand(scores.shape[0], -1)
    if running is not None:
        scores, pos = torch.cat([running[0], scores], 1), torch.cat([running[1], pos], 1)
    values, order = sort_topk(scores, k)
    return values, pos.gather(1, order)


def tie_heavy_scores(n: int, m: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Scores drawn mostly from a few values — exact zeros of both signs (relu), -inf (hidden keys) — plus some
    continuous ones, so that ties straddle every cut."""
    few = torch.tensor([float("-inf"), -1.0, -0.0, 0.0, 0.5, 1.0, 2.0], dtype=dtype)
    scores = few[torch.randint(0, len(few), (n, m), generator=gen)]
    continuous = torch.rand(n, m, generator=gen) < 0.2
    return torch.where(continuous, torch.randn(n, m, generator=gen, dtype=dtype), scores)


@pytest.mark.parametrize("on_device", [False, True], ids=["ties-checked-on-host", "ties-broken-on-the-device"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stable_topk_equals_a_stable_sort_on_scores_with_many_ties(dtype: torch.dtype, on_device, monkeypatch) -> None:
    """As on CPU (ties broken where a check finds them straddling the cut) and as on a GPU (always, waiting for
    nothing on the host)."""
    if on_device:
        monkeypatch.setattr(mla, "ties_checked_on_host", lambda scores: False)
    gen = torch.Generator().manual_seed(0)
    for n, m in [(1, 1), (7, 5), (16, 64), (48, 700)]:
        scores = tie_heavy_scores(n, m, dtype, gen)
        for k in sorted({1, 3, 4, 8, 256, max(m - 1, 1), m, m + 5}):
            values, columns = stable_topk(scores, k)
            expected_values, expected_columns = sort_topk(scores, k)
            assert torch.equal(columns, expected_columns), (n, m, k)
            assert torch.equal(values, expected_values) and torch.equal(values.signbit(), expected_values.signbit())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [1, 40, 300, 1 << 20])
def test_best_keys_selects_what_merging_piece_by_piece_selects(dtype: torch.dtype, budget: int) -> None:
    """Pieces of keys reduced in groups (every piece, some, all at once) against a stable sort after every piece,
    from nothing and from a running best padded with position -1 at -inf (as the context-parallel merge gives)."""
    gen = torch.Generator().manual_seed(1)
    n, k = 6, 8
    padded = (
        torch.cat([tie_heavy_scores(n, 5, dtype, gen), torch.full((n, 3), float("-inf"), dtype=dtype)], 1),
        torch.cat([torch.randint(0, 30, (n, 5), generator=gen), torch.full((n, 3), -1)], 1),
    )
    for running in (None, padded):
        best, expected = BestKeys(k, budget, running), running
        start = 30
        for m in (1, 3, 9, 2, 17, 5):
            scores, positions = tie_heavy_scores(n, m, dtype, gen), torch.arange(start, start + m)
            best.add(scores, positions)
            expected = merge_by_sort(expected, scores, positions, k)
            start += m
        result = best.result()
        assert result is not None and expected is not None
        assert torch.equal(result[1], expected[1]) and torch.equal(result[0], expected[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_selections_equal_the_stable_sort_definition(dtype: torch.dtype, monkeypatch) -> None:
    """Every DSA selection of a capture and its extends — tiny pieces of keys and chunks, topk 4, where exact-zero
    index scores tie across the cut — equals the one made with a stable sort of whole rows."""
    net, ids = model(dtype, 4), token_ids(80, seed=5)
    recorded: list[Tensor] = []
    select = mla.DSAIndexer.select

    def recording(self, *args, **kwargs):
        selected = select(self, *args, **kwargs)
        recorded.append(selected)
        return selected

    def run() -> list[Tensor]:
        recorded.clear()
        engine = Engine(net, EngineConfig(chunk_size=16, max_score_elements=64))
        with torch.no_grad():
            state = engine.capture(ids[:37])
            state = engine.extend(state, ids[37:61])
            engine.logits(state, ids[61:])
        return list(recorded)

    straddling = []
    earliest_at_cut = mla._earliest_at_cut
    monkeypatch.setattr(mla, "_earliest_at_cut", lambda *a: straddling.append(1) or earliest_at_cut(*a))
    monkeypatch.setattr(mla.DSAIndexer, "select", recording)
    fast = run()
    monkeypatch.setattr(mla, "stable_topk", sort_topk)
    by_sort = run()
    assert straddling  # ties did straddle the cut
    assert len(fast) == len(by_sort) > 0
    for a, b in zip(fast, by_sort, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
