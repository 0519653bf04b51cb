"""Triton kernels the model adapters call on a GPU, each beside the pure-torch path that stays its reference and the
CPU fallback. Triton is optional: ``triton_available()`` says whether it imports; on a machine without a GPU the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported), which is how the suite
tests them against the fp64 reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    """Triton can be imported (it comes with torch's CUDA wheels; on CPU it is a test dependency)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors, numpy arithmetic)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


DSA_KERNELS_ENV = "LONGSTRAW_DSA_KERNELS"


def dsa_kernels_on() -> bool:
    """DSA's Triton kernels (index scores, sparse attention) may run on CUDA tensors: Triton is installed and
    ``LONGSTRAW_DSA_KERNELS`` is not ``0`` (``bench/gpu.sh`` sets it where their GPU parity test failed; the
    gathered torch paths run instead)."""
    return triton_available() and os.environ.get(DSA_KERNELS_ENV, "1") != "0"
