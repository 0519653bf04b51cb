"""The tags of the engine's point-to-point messages, defined once for every schedule that sends them.

A sharded capture and exact mode's wavefront walk send over the same transport (gloo matches a message by its
sender and tag; NCCL ignores tags, and ``parallel.discipline`` compares them). A tag names what a message carries —
its kind, the run (a rank's consecutive chunks) and the layer of the cell it serves — and no two kinds share one:

    tag = kind << (RUN_BITS + LAYER_BITS) | run << LAYER_BITS | layer

``message_tag`` refuses a run or layer past its field, and the schedules check their sizes (``check_tag_bounds``)
before any message is sent, on every rank alike.
"""

from __future__ import annotations

from enum import IntEnum

LAYER_BITS = 12  # layers < 4096
RUN_BITS = 12  # runs of one extend < 4096 (a balanced cut over N ranks makes 2N - 1)
MAX_LAYERS = 1 << LAYER_BITS
MAX_RUNS = 1 << RUN_BITS


class MessageKind(IntEnum):
    """What a message carries."""

    CAPTURE_ROWS = 1  # a capture: a growing layer's rows before a run
    CAPTURE_RECURRENT = 2  # a capture: a recurrent layer's state after the run before
    WALK_ROWS = 3  # the walk: a growing layer's rows before a run, for the cell's backward
    WALK_RECOMPUTE_ROWS = 4  # the walk: the same rows, for the recomputation of the cell's segment
    ROW_GRADS = 5  # the walk: the gradient a cell gives another rank's rows
    RECURRENT_GRAD = 6  # the walk: the gradient of the recurrent state before a run
    CONTEXT_GRADS = 7  # the walk: the gradient of a rank's context rows (sent when the walk is done)


# every tag fits a signed 32-bit integer (the widest a backend's tag need be)
assert max(MessageKind) < 1 << (31 - RUN_BITS - LAYER_BITS)


def message_tag(kind: MessageKind, run: int, layer: int) -> int:
    """The tag of a message of ``kind`` serving cell ``(run, layer)``."""
    if not 0 <= run < MAX_RUNS or not 0 <= layer < MAX_LAYERS:
        raise ValueError(f"a message tag holds runs below {MAX_RUNS} and layers below {MAX_LAYERS}: got {run}, {layer}")
    return int(kind) << (RUN_BITS + LAYER_BITS) | run << LAYER_BITS | layer


def check_tag_bounds(runs: int, layers: int) -> None:
    """Refuse a schedule of ``runs`` runs over ``layers`` layers whose messages' tags would not be unique."""
    if runs > MAX_RUNS or layers > MAX_LAYERS:
        raise ValueError(
            f"the engine's message tags hold at most {MAX_RUNS} runs and {MAX_LAYERS} layers; this schedule has "
            f"{runs} runs over {layers} layers"
        )
