"""Decoding over static buffers, captured in CUDA graphs on a GPU (``Decoder(graphs=True)``, step_graph.py).

On CPU the static step runs eagerly (``EagerStep``), the stand-in for a capture: it must give the eager decoder's
logits and states through every change of the batch's shape class (members leaving, compaction, a session buffer
growing), re-entering a class only at those changes, and it must do nothing a capture cannot hold
(``host_syncs``). The tests marked ``gpu`` capture real graphs (``pytest -m gpu``, run by bench/gpu.sh)."""

from __future__ import annotations

import warnings

import pytest
import torch
from decoding_cases import GROUPS, PROMPTS, decode_both_ways, max_logprob_gap

import longstraw_agents.engine.decoding as decoding
import longstraw_agents.models.mla as mla
from longstraw_agents.engine import Engine
from longstraw_agents.engine.decoding import Decoder, Member
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.state import State
from longstraw_agents.step_graph import CudaGraphStep, EagerStep, host_syncs

CAPTURABLE = {"dense": "qwen3", "hybrid": "qwen3_5", "mla": "glm_moe_dsa"}
STEPS = 8
LEAVING = {1: [1], 4: [2], 5: [3]}  # after step t, these members leave
PROBE = [7, 8, 9]


def session(engine: Engine, graphs: bool) -> tuple[list[torch.Tensor], list[State], Decoder]:
    """Four members sharing a 20-token prompt and one alone (its 3 tokens in the session buffers, which hold 6
    positions at first), teacher-forced for 8 steps while members leave: each step's logits, every member's final
    state and the decoder. Static steps enter 3 shape classes: 5 rows; 4 rows once the lone member's buffer grows at
    step 3 (the row of member 1, who left after step 1, compacted away); 2 rows once 2 of those 4 have left."""
    fork, lone = engine.capture(list(range(10, 30))), engine.capture([50, 51, 52])
    decoder = Decoder(engine, [Member(fork, fork)] * 4 + [Member(lone)], reserve=2, graphs=graphs)
    tokens = torch.randint(0, 256, (5, STEPS), generator=torch.Generator().manual_seed(0))
    logits, states = [], {}
    for t in range(STEPS):
        logits.append(decoder.step(tokens[decoder.live, t]))
        states.update(zip(LEAVING.get(t, []), decoder.leave(LEAVING.get(t, [])), strict=True))
    states.update(zip(decoder.live, decoder.leave(list(decoder.live)), strict=True))
    return logits, [states[k] for k in range(5)], decoder


def gap(engine: Engine, a: tuple[list[torch.Tensor], list[State], Decoder], b) -> float:
    """The largest log-probability gap between two sessions: their steps' logits and their final states' logits."""
    steps = max(max_logprob_gap(x, y) for x, y in zip(a[0], b[0], strict=True))
    with torch.no_grad():
        states = max(
            max_logprob_gap(engine.logits(x, PROBE), engine.logits(y, PROBE)) for x, y in zip(a[1], b[1], strict=True)
        )
    return max(steps, states)


@pytest.fixture(scope="module", params=list(CAPTURABLE))
def engine(request) -> Engine:
    return Engine(tiny_model(CAPTURABLE[request.param], dtype=torch.float64), chunk_size=8)


class CheckedStep(EagerStep):
    """An eager step that records what ``host_syncs`` finds in it."""

    found: list[str] = []
    calls = 0

    def __call__(self) -> torch.Tensor:
        with host_syncs() as found:
            out = self.fn()
        CheckedStep.found += found
        CheckedStep.calls += 1
        return out


@pytest.fixture
def checked(monkeypatch) -> type[CheckedStep]:
    monkeypatch.setattr(decoding, "EagerStep", CheckedStep)
    monkeypatch.setattr(CheckedStep, "found", [])
    monkeypatch.setattr(CheckedStep, "calls", 0)
    return CheckedStep


def test_static_steps_equal_the_eager_decoder_through_shape_class_changes(engine):
    eager, static = session(engine, graphs=False), session(engine, graphs=True)
    assert gap(engine, eager, static) < 1e-12
    assert (eager[2].graphs, eager[2].shape_classes) == (False, 0)
    assert (static[2].graphs, static[2].shape_classes) == (True, 3)


def test_static_steps_match_stepping_each_member_alone(engine):
    """The shared cases of tests/test_decoding.py: groups, a lone member, a whole group leaving, a tool turn."""
    assert decode_both_ways(engine, PROMPTS, GROUPS, graphs=True) < 1e-12


def test_the_static_step_waits_for_nothing_on_the_host(engine, checked, monkeypatch):
    """Nothing a CUDA graph cannot capture, in any shape class: the function the graphs capture is what runs (DSA's
    top-k as on a GPU, where it breaks ties without looking whether any straddles the cut)."""
    monkeypatch.setattr(mla, "ties_checked_on_host", lambda scores: False)
    session(engine, graphs=True)
    assert checked.calls == STEPS and checked.found == [], checked.found


def test_a_family_whose_step_waits_for_the_host_decodes_eagerly_and_says_so_once(checked, monkeypatch):
    engine = Engine(tiny_model("qwen3", dtype=torch.float64), chunk_size=8)
    monkeypatch.setattr(type(engine.adapter), "decode_graph_blocker", "waits for the host: a test says so")
    fork = engine.capture([1, 2, 3, 4])
    with pytest.warns(RuntimeWarning, match="dense family's step waits for the host: a test says so"):
        assert not Decoder(engine, [Member(fork, fork)] * 2, graphs=True).graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        decoder = Decoder(engine, [Member(fork, fork)] * 2, graphs=True)
        decoder.step([5, 6])
    assert not decoder.graphs and decoder.shape_classes == 0 and checked.calls == 0


def test_dsa_turning_sparse_mid_session_enters_a_shape_class_of_its_own(checked, monkeypatch):
    """The GLM-5.2 layout with top-24 keys: the members of a 20-token prompt see every key for their first steps
    (dense attention), then more than 24 (sparse): the static step enters a class for each, and equals the eager
    decoder's logits throughout, waiting for nothing on the host in either."""
    monkeypatch.setattr(mla, "ties_checked_on_host", lambda scores: False)
    engine = Engine(tiny_model("glm_moe_dsa", dtype=torch.float64, index_topk=24), chunk_size=8)
    eager, static = session(engine, graphs=False), session(engine, graphs=True)
    assert gap(engine, eager, static) < 1e-12
    assert static[2].shape_classes == 4 and checked.calls == STEPS and checked.found == []


def test_graphs_default_to_the_eager_step_off_cuda():
    engine = Engine(tiny_model("llama"))
    state = engine.capture([1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not Decoder(engine, [Member(state)]).graphs


SYNCS = {
    "item": lambda x, m: x.sum().item(),
    "int": lambda x, m: int(x[0]),
    "if": lambda x, m: 1 if x.max() > 0 else 0,
    "tolist": lambda x, m: x.tolist(),
    "numpy": lambda x, m: x.numpy(),
    "tensor": lambda x, m: torch.tensor([1, 2]),
    "as_tensor": lambda x, m: torch.as_tensor([1.0, 2.0]),
    "nonzero": lambda x, m: m.nonzero(),
    "where one argument": lambda x, m: torch.where(m),
    "unique": lambda x, m: torch.unique(x),
    "mask indexing": lambda x, m: x[m],
    "mask assignment": lambda x, m: x.clone().index_put_((m,), torch.zeros(())),
    "masked_select": lambda x, m: x.masked_select(m),
    "repeat counts": lambda x, m: x.repeat_interleave(m.long()),
}
CLEAN = {
    "arithmetic": lambda x, m: (x * 2).exp().sum(),
    "index tensor": lambda x, m: x[torch.arange(2)],
    "index assignment": lambda x, m: x.clone().index_put_((torch.arange(2),), torch.zeros(())),
    "where three arguments": lambda x, m: torch.where(m, x, 0.0),
    "masked_fill": lambda x, m: x.masked_fill(m, 0.0),
    "repeat": lambda x, m: x.repeat_interleave(2),
    "topk and gather": lambda x, m: x.gather(0, x.topk(2).indices),
    "as_tensor of a tensor": lambda x, m: torch.as_tensor(x),
    "in-place": lambda x, m: x.clone().add_(m.long()),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_host_syncs_finds_what_a_capture_cannot_hold(name):
    x, m = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([True, False, True])
    with host_syncs() as found:
        SYNCS[name](x, m)
    assert found, name


@pytest.mark.parametrize("name", list(CLEAN))
def test_host_syncs_lets_device_work_pass(name):
    x, m = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([True, False, True])
    with host_syncs() as found:
        CLEAN[name](x, m)
    assert found == []


# --- on a GPU: real captures -------------------------------------------------------------------------------------


def cuda_engine(family: str, dtype: torch.dtype) -> Engine:
    return Engine(tiny_model(CAPTURABLE[family], dtype=dtype).to("cuda"), chunk_size=8)


class TracedGraphStep(CudaGraphStep):
    """A CUDA graph step that keeps track of its instances."""

    made: list[CudaGraphStep] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        TracedGraphStep.made.append(self)


class EagerOnCuda(EagerStep):
    """The static step run eagerly where a CUDA graph would capture it."""

    def __init__(self, fn, device: torch.device, check: bool = True):
        super().__init__(fn)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(CAPTURABLE))
def test_cuda_graphs_give_the_eager_steps_logits(family, dtype, monkeypatch):
    """Captured and replayed, through 3 shape classes: the same static step run eagerly exactly (fp32: the same
    kernels on the same data), and the eager decoder within rounding."""
    engine = cuda_engine(family, dtype)
    monkeypatch.setattr(decoding, "CudaGraphStep", TracedGraphStep)
    monkeypatch.setattr(TracedGraphStep, "made", [])
    captured = session(engine, graphs=True)
    assert captured[2].shape_classes == 3 and len(TracedGraphStep.made) == 3
    assert all(g.captured and g.refused is None for g in TracedGraphStep.made)
    monkeypatch.setattr(decoding, "CudaGraphStep", EagerOnCuda)
    static_eager = session(engine, graphs=True)
    eager = session(engine, graphs=False)
    if dtype == torch.float32:
        for replayed, run in zip(captured[0], static_eager[0], strict=True):
            assert torch.equal(replayed, run), "a replayed graph computed other values than its function run eagerly"
    assert gap(engine, captured, eager) < (1e-4 if dtype == torch.float32 else 5e-2)


@pytest.mark.gpu
def test_a_graph_step_runs_once_per_call_and_replays_after_its_warm_up():
    x = torch.zeros(4, device="cuda")

    def step() -> torch.Tensor:
        x.add_(1)
        return x * 2

    graph = CudaGraphStep(step, x.device)
    outputs = [graph().clone() for _ in range(3)]
    assert graph.captured and graph.refused is None
    assert [float(o[0]) for o in outputs] == [2.0, 4.0, 6.0] and float(x[0]) == 3.0  # the capture ran nothing


@pytest.mark.gpu
def test_a_step_that_waits_for_the_host_is_run_eagerly_not_captured():
    x = torch.zeros(4, device="cuda")

    def step() -> torch.Tensor:
        x.add_(1)
        return x * float(x.sum())

    graph = CudaGraphStep(step, x.device)
    with pytest.warns(RuntimeWarning, match="reads a tensor's value on the host"):
        first = graph()
    assert not graph.captured and "_local_scalar_dense" in (graph.refused or "")
    assert float(first[0]) == 4.0 and float(graph()[0]) == 16.0
