"""The matrix products the DSA kernels share: full precision, or bf16 tensor cores with fp32 sums.

``operand`` turns a tile into what ``dot`` multiplies: the accumulator's dtype (full precision: fp32 without TF32, or
fp64), or bf16 (``FAST``). Triton's interpreter multiplies bf16 tiles wrongly (it reads their raw bits), so under it
(``EMULATE``) a fast operand is rounded to bf16 and multiplied in the accumulator's precision: the same products
(a product of two bf16 values is exact in fp32) and sums in fp32, as a bf16 tensor core gives, in another order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def operand(x, FAST: tl.constexpr, EMULATE: tl.constexpr, ACC: tl.constexpr):
    if FAST:
        if EMULATE:
            return x.to(tl.bfloat16).to(ACC)
        return x.to(tl.bfloat16)
    return x.to(ACC)


@triton.jit
def dot(a, b, FAST: tl.constexpr, EMULATE: tl.constexpr):
    if FAST and not EMULATE:
        return tl.dot(a, b)
    return tl.dot(a, b, input_precision="ieee")
