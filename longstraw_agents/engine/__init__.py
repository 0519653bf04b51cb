"""Incremental prefill: evaluate shared context once without autograd, keep only what later tokens need.

    engine = Engine(model)                    # a transformers CausalLM of a supported family, any dtype
    state = engine.capture(prefix_ids)        # chunked, no graph; state.num_tokens, state.nbytes
    logits = engine.logits(state, ids)        # == model(cat(prefix, ids)).logits[0, len(prefix):]
    child = engine.extend(state, more_ids)    # covers prefix + more_ids; `state` stays valid and unchanged

Exact gradients through the prefix (DESIGN.md, "Exact gradients"): pass a ``StateGrad`` to ``logits`` so the
state's tensors enter the branch graph as leaves whose gradient is accumulated into it, then call ``backward`` to
walk the state's chunks in reverse, recomputing each under autograd from the K/V of earlier chunks and the
recurrent state checkpointed at its start, and backpropagating into the parameters and earlier chunks.

The package, one concern a module:

- ``config``: ``EngineConfig`` and the spacings derived from it;
- ``engine``: ``Engine``, the public front: it picks the schedule each call runs;
- ``kit``: the execution kit every schedule runs layers with (``ExecutionKit``: the adapter, attention, the weights'
  gathers, chunk bookkeeping) and the layer-context helpers they share; it depends on no schedule;
- ``chunked_extend``: an extend chunk by chunk (in one process, or replicated on every context-parallel rank);
- ``reverse_walk``: exact mode's walk in one process (or replicated on every context-parallel rank);
- ``graphs``: kept chunk graphs within a memory budget (``GraphBank``);
- ``shards``: context parallelism as the engine sees it — who stores which positions (``Ownership``) and the
  messages between ranks (``Transport``), implemented by ``longstraw_agents.parallel``;
- ``tags``: the tags of those messages, one range per kind;
- ``sharded_capture``: a capture computed shard by shard, layer by layer, in a wavefront over the ranks, keeping
  its layer inputs (``state.LayerInputs``);
- ``wavefront``: exact mode's walk over such a capture in a wavefront;
- ``decoding``: batched decoding over engine states (``Decoder``), a forward per generated token for a batch.
"""

from longstraw_agents.models import StateSize, state_size
from longstraw_agents.state import LayerInputs, State, StateGrad

from .config import EngineConfig, GradAccumulation, checkpoint_spacing, layer_inputs_spacing
from .engine import Backward, Engine
from .graphs import GraphBank, KeptGraph
from .kit import ChunkLoss, ExecutionKit
from .schedule import capture_waves
from .shards import Ownership, StateShards, Transport
from .weights import LayerWeights

__all__ = [
    "Backward",
    "ChunkLoss",
    "Engine",
    "EngineConfig",
    "ExecutionKit",
    "GradAccumulation",
    "GraphBank",
    "KeptGraph",
    "LayerInputs",
    "LayerWeights",
    "Ownership",
    "State",
    "StateGrad",
    "StateShards",
    "StateSize",
    "Transport",
    "capture_waves",
    "checkpoint_spacing",
    "layer_inputs_spacing",
    "state_size",
]
