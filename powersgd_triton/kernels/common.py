"""Helpers shared by the bucket kernels: table reads, loop bounds read from device tables, rounding stores.

``loop_range``: the iterator of every loop whose bound is read from a device table (``for k0 in loop_range(0, m,
BLOCK_K)``). Compiled, it is ``tl.range`` (a loop the software pipeliner sees, ``num_stages``). Under Triton's
interpreter every scalar is a one-element numpy array, and Triton 3.6's interpreter turns a loop bound into a Python
int with ``int(array)``, which numpy >= 2.4 refuses for arrays of one dimension (``TypeError: only 0-dimensional
arrays can be converted to Python scalars``); there ``loop_range`` reads the element itself. The choice is made once,
from how ``triton.jit`` wrapped a probe function here (the same test Triton makes for every kernel of this package).
"""

import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def _as_int(value) -> int:
    """A Python int from an interpreter scalar (one-element array), a constexpr or an int."""
    handle = getattr(value, "handle", None)
    if handle is not None:
        return int(handle.data.reshape(-1)[0])
    return int(getattr(value, "value", value))


if INTERPRETED:

    def loop_range(*args):
        """``range`` over bounds the interpreter holds as one-element arrays (see the module docstring)."""
        return range(*(_as_int(a) for a in args))

else:
    loop_range = tl.range


@triton.jit
def _load_matrix_row(table_ptr, mat):
    """The row of matrix ``mat`` of the int64 layout table (``layout.TABLE_COLUMNS``)."""
    row = table_ptr + mat * 8
    off = tl.load(row + 0)
    n = tl.load(row + 1)
    m = tl.load(row + 2)
    numel = tl.load(row + 3)
    r = tl.load(row + 4)
    p_off = tl.load(row + 5)
    q_off = tl.load(row + 6)
    e_off = tl.load(row + 7)
    return off, n, m, numel, r, p_off, q_off, e_off


@triton.jit
def _cast_for_store(x, ptr):
    """float32 ``x`` -> ``ptr``'s element type, rounding to nearest even (as ``torch.Tensor.to``).

    For bfloat16 the rounding is done on the bits, so that the interpreter (which truncates in
    ``.to(tl.bfloat16)``) and the GPU give torch's result: ``(bits + 0x7FFF + lsb) >> 16``, which also rounds
    finite values past the largest bfloat16 to inf. NaN is tested first: every NaN (any sign, any payload, e.g. the
    ``0x7FFFFFFF`` NVIDIA arithmetic produces, or ``0x7F800001``) stays a NaN of the same sign with the quiet bit set
    (the rounding add would carry a NaN payload into the exponent and give -0.0, +0.0 or inf).
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        out = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
        return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def _flags_all(flags_ptr, n_flags, FBLOCK: tl.constexpr):
    """1 if bit 0 (finite) is set in every one of the ``n_flags`` uint8 flags, else 0 (int32 scalar)."""
    acc = tl.full((FBLOCK,), 1, tl.int32)
    for f0 in loop_range(0, n_flags, FBLOCK):
        idx = f0 + tl.arange(0, FBLOCK)
        acc = acc & tl.load(flags_ptr + idx, mask=idx < n_flags, other=1).to(tl.int32)
    return tl.min(acc, axis=0) & 1


@triton.jit
def _flags_any_nonzero(flags_ptr, first_ptr, mat, FBLOCK: tl.constexpr):
    """1 if bit 1 (non-zero) is set in any flag of matrix ``mat`` (flags ``first[mat]:first[mat + 1]``), else 0."""
    begin = tl.load(first_ptr + mat)
    end = tl.load(first_ptr + mat + 1)
    acc = tl.zeros((FBLOCK,), tl.int32)
    for f0 in loop_range(begin, end, FBLOCK):
        idx = f0 + tl.arange(0, FBLOCK)
        acc = acc | tl.load(flags_ptr + idx, mask=idx < end, other=0).to(tl.int32)
    return (tl.max(acc, axis=0) >> 1) & 1
