"""The one token-id check: integers from a tensor, a numpy array or a sequence; never a cast from floats or bools."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longstraw_agents.token_ids import as_token_ids


@pytest.mark.parametrize(
    "ids",
    [[3, 4, 5], (3, 4, 5), range(3, 6), np.array([3, 4, 5], np.int32), np.array([3, 4, 5], np.uint8),
     torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int16)],
    ids=["list", "tuple", "range", "numpy-int32", "numpy-uint8", "tensor", "tensor-int16"],
)  # fmt: skip
def test_integer_ids_of_any_container_become_a_long_tensor(ids):
    out = as_token_ids(ids)
    assert out.dtype == torch.long and out.tolist() == [3, 4, 5]


@pytest.mark.parametrize(
    ("ids", "dtype"),
    [([3.9, 4.0], "float64"), (np.array([3.0], np.float32), "float32"), (torch.tensor([1.0]), "float32"),
     ([True, False], "bool"), (torch.tensor([True]), "bool"), (torch.zeros(0), "float32")],
)  # fmt: skip
def test_floats_and_bools_are_refused_never_cast(ids, dtype):
    with pytest.raises(TypeError, match=f"^prompt_ids: token ids must be integers, got dtype {dtype}$"):
        as_token_ids(ids, "prompt_ids")


def test_what_is_not_a_sequence_of_ints_is_a_type_error():
    for bad in ("not ids", 5, [[1, 2], [3]]):
        with pytest.raises(TypeError, match="token ids must be"):
            as_token_ids(bad)


def test_shape_emptiness_and_range_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^completion 1: expected a 1-D sequence, got shape \(1, 2\)$"):
        as_token_ids([[6, 7]], "completion 1")
    with pytest.raises(ValueError, match=r"^token ids: expected a 1-D sequence, got shape \(\)$"):
        as_token_ids(torch.tensor(3))
    with pytest.raises(ValueError, match="^prompt_ids is empty: pass at least one token$"):
        as_token_ids([], "prompt_ids")
    with pytest.raises(ValueError, match="^token ids are empty: pass at least one token$"):
        as_token_ids(torch.zeros(0, dtype=torch.long))
    assert as_token_ids([], allow_empty=True, vocab_size=8).shape == (0,)
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, 8\); got values in \[-1, 8\]$"):
        as_token_ids([-1, 3, 8], vocab_size=8)
    assert as_token_ids([0, 7], vocab_size=8).tolist() == [0, 7]
