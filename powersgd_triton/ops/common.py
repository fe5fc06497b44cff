"""Helpers shared by the bucket kernels: table columns and reads, M tiles (and M + E of project and project_t), loop
bounds read from device tables, rounding stores.

The columns of the layout table and of the tile tables are named once, in :mod:`powersgd_triton.ops.tables`; the
kernels use them as the module-level ``tl.constexpr`` globals below (same names: ``RANK``, ``TABLE_WIDTH``,
``RECON_ROW0``, ...), which Triton folds at compile time exactly like literals, and which its interpreter reads as Python ints.

``loop_range``: the iterator of every loop whose bound is read from a device table (``for k0 in loop_range(0, m,
BLOCK_K)``). Compiled, it is ``tl.range`` (a loop the software pipeliner sees, ``num_stages``). Under Triton's
interpreter every scalar is a one-element numpy array, and Triton 3.6's interpreter turns a loop bound into a Python
int with ``int(array)``, which numpy >= 2.4 refuses for arrays of one dimension (``TypeError: only 0-dimensional
arrays can be converted to Python scalars``); there ``loop_range`` reads the element itself. The choice is made once,
from how ``triton.jit`` wrapped a probe function here (the same test Triton makes for every kernel of this package).
"""

import triton
import triton.language as tl

from powersgd_triton.ops import tables as _tables

# The layout table (int64 [L, TABLE_WIDTH], tables.TABLE_COLUMNS: layout.TABLE_COLUMNS).
TABLE_WIDTH = tl.constexpr(_tables.TABLE_WIDTH)
OFF = tl.constexpr(_tables.OFF)
ROWS = tl.constexpr(_tables.ROWS)
COLS = tl.constexpr(_tables.COLS)
NUMEL = tl.constexpr(_tables.NUMEL)
RANK = tl.constexpr(_tables.RANK)
P_OFF = tl.constexpr(_tables.P_OFF)
Q_OFF = tl.constexpr(_tables.Q_OFF)
E_OFF = tl.constexpr(_tables.E_OFF)
# project's tiles (int32 [T, TILE_WIDTH], tables.TILE_COLUMNS).
TILE_WIDTH = tl.constexpr(_tables.TILE_WIDTH)
TILE_MAT = tl.constexpr(_tables.TILE_MAT)
TILE_FIRST = tl.constexpr(_tables.TILE_FIRST)
# project_t's tiles (int32 [T, PROJECT_T_TILE_WIDTH], tables.PROJECT_T_TILE_COLUMNS).
PROJECT_T_TILE_WIDTH = tl.constexpr(_tables.PROJECT_T_TILE_WIDTH)
PROJECT_T_MAT = tl.constexpr(_tables.PROJECT_T_MAT)
PROJECT_T_COL0 = tl.constexpr(_tables.PROJECT_T_COL0)
PROJECT_T_ROW0 = tl.constexpr(_tables.PROJECT_T_ROW0)
PROJECT_T_ROW_END = tl.constexpr(_tables.PROJECT_T_ROW_END)
PROJECT_T_WS_OFF = tl.constexpr(_tables.PROJECT_T_WS_OFF)
# reduce_splits' tiles (int32 [T, REDUCE_TILE_WIDTH], tables.REDUCE_TILE_COLUMNS).
REDUCE_TILE_WIDTH = tl.constexpr(_tables.REDUCE_TILE_WIDTH)
REDUCE_MAT = tl.constexpr(_tables.REDUCE_MAT)
REDUCE_COL0 = tl.constexpr(_tables.REDUCE_COL0)
REDUCE_WS_OFF = tl.constexpr(_tables.REDUCE_WS_OFF)
REDUCE_SPLITS = tl.constexpr(_tables.REDUCE_SPLITS)
# reconstruct's tiles (int32 [T, RECON_TILE_WIDTH], tables.RECON_TILE_COLUMNS).
RECON_TILE_WIDTH = tl.constexpr(_tables.RECON_TILE_WIDTH)
RECON_MAT = tl.constexpr(_tables.RECON_MAT)
RECON_ROW0 = tl.constexpr(_tables.RECON_ROW0)
RECON_COL0 = tl.constexpr(_tables.RECON_COL0)
RECON_COL_END = tl.constexpr(_tables.RECON_COL_END)
# average's tiles (int64 [T, AVERAGE_TILE_WIDTH], tables.AVERAGE_TILE_COLUMNS).
AVERAGE_TILE_WIDTH = tl.constexpr(_tables.AVERAGE_TILE_WIDTH)
AVERAGE_MAT = tl.constexpr(_tables.AVERAGE_MAT)
AVERAGE_SRC = tl.constexpr(_tables.AVERAGE_SRC)
AVERAGE_DST = tl.constexpr(_tables.AVERAGE_DST)
AVERAGE_COUNT = tl.constexpr(_tables.AVERAGE_COUNT)
# orthogonalize's task tables (int64, tables.ORTHO_GRAM_TASK_COLUMNS and tables.ORTHO_TASK_COLUMNS).
ORTHO_GRAM_TASK_WIDTH = tl.constexpr(_tables.ORTHO_GRAM_TASK_WIDTH)
GRAM_MAT = tl.constexpr(_tables.GRAM_MAT)
GRAM_ROW0 = tl.constexpr(_tables.GRAM_ROW0)
GRAM_SLOT = tl.constexpr(_tables.GRAM_SLOT)
GRAM_HEAD = tl.constexpr(_tables.GRAM_HEAD)
GRAM_RM = tl.constexpr(_tables.GRAM_RM)
GRAM_N = tl.constexpr(_tables.GRAM_N)
GRAM_R = tl.constexpr(_tables.GRAM_R)
GRAM_OFF = tl.constexpr(_tables.GRAM_OFF)
ORTHO_TASK_WIDTH = tl.constexpr(_tables.ORTHO_TASK_WIDTH)
ORTHO_MAT = tl.constexpr(_tables.ORTHO_MAT)
ORTHO_ROW0 = tl.constexpr(_tables.ORTHO_ROW0)
ORTHO_ROW_END = tl.constexpr(_tables.ORTHO_ROW_END)
ORTHO_SLOT0 = tl.constexpr(_tables.ORTHO_SLOT0)
ORTHO_SLOTS = tl.constexpr(_tables.ORTHO_SLOTS)
ORTHO_HEAD = tl.constexpr(_tables.ORTHO_HEAD)
ORTHO_RM = tl.constexpr(_tables.ORTHO_RM)
ORTHO_N = tl.constexpr(_tables.ORTHO_N)
ORTHO_R = tl.constexpr(_tables.ORTHO_R)
ORTHO_OFF = tl.constexpr(_tables.ORTHO_OFF)


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

# Operand type of the tensor-core dots of the split path (:func:`_dot_bf16_split`): bfloat16 on the GPU. Triton's
# interpreter multiplies bfloat16 operands of ``tl.dot`` as raw integers (triton issue #11584; notes/triton.md
# §2.5), so there the same bfloat16-valued pieces are passed as float32 (their products are exact either way).
SPLIT_OPERAND = tl.constexpr(tl.float32 if INTERPRETED else tl.bfloat16)


@triton.jit
def _load_matrix_row(table_ptr, mat):
    """The row of matrix ``mat`` of the int64 layout table (``layout.TABLE_COLUMNS``)."""
    row = table_ptr + mat * TABLE_WIDTH
    off = tl.load(row + OFF)
    n = tl.load(row + ROWS)
    m = tl.load(row + COLS)
    numel = tl.load(row + NUMEL)
    r = tl.load(row + RANK)
    p_off = tl.load(row + P_OFF)
    q_off = tl.load(row + Q_OFF)
    e_off = tl.load(row + E_OFF)
    return off, n, m, numel, r, p_off, q_off, e_off


@triton.jit
def _aligned_matrix_row(table_ptr, mat, VEC: tl.constexpr, R: tl.constexpr):
    """The row of matrix ``mat`` of the layout table for the aligned kernels (``ALIGN``: the layout is
    :func:`powersgd_triton.ops.aligned.vector_width`'s): ``(off, n, m, p_off, q_off, e_off)`` with ``n`` and ``m``
    as int32 (every matrix has fewer than 2^31 elements) and the alignment the layout guarantees declared to the
    compiler: ``off`` and ``m`` multiples of ``VEC`` elements of the bucket's dtype (16 bytes), ``e_off`` of 4
    (16 bytes of float32), ``p_off`` and ``q_off`` of ``R`` (every rank is ``R``). The hints sit on the loads
    themselves (a hint on a helper's result does not reach the caller's code)."""
    row = table_ptr + mat * TABLE_WIDTH
    off = tl.multiple_of(tl.load(row + OFF), VEC)
    n = tl.load(row + ROWS).to(tl.int32)
    m = tl.multiple_of(tl.load(row + COLS).to(tl.int32), VEC)
    p_off = tl.multiple_of(tl.load(row + P_OFF), R)
    q_off = tl.multiple_of(tl.load(row + Q_OFF), R)
    e_off = tl.multiple_of(tl.load(row + E_OFF), 4)
    return off, n, m, p_off, q_off, e_off


@triton.jit
def _load_m_and_pad_error(m_ptr, e_ptr, rows, row_ok, cols, col_ok, m, numel, PAD_ERROR: tl.constexpr):
    """The ``[rows, cols]`` tile of a row-major ``n x m`` matrix M with ``numel`` valid elements (masked where
    ``row_ok``/``col_ok`` are false and at flat indices ``>= numel``), and, with ``PAD_ERROR`` (the batched view),
    the error memory of its padding: E at the flat indices ``>= numel`` inside the tile, zeros elsewhere (else one
    ``[1, 1]`` zero). As stored (not upcast). Used by reconstruct, for which the padding's ``M + E`` is its error
    memory; project reads the error of the whole matrix instead
    (:func:`powersgd_triton.ops.projection._project_loads`), and project_t masks its wide tiles per row
    (:func:`powersgd_triton.ops.projection_t._project_t_loads`)."""
    lin = rows[:, None] * m + cols[None, :]
    inside = row_ok[:, None] & col_ok[None, :]
    x = tl.load(m_ptr + lin, mask=inside & (lin < numel), other=0.0)
    if PAD_ERROR:
        e = tl.load(e_ptr + lin, mask=inside & (lin >= numel), other=0.0)
    else:
        e = tl.zeros((1, 1), dtype=tl.float32)
    return x, e


@triton.jit
def _m_plus_error(x_raw, e_raw, scale, WITH_ERROR: tl.constexpr, LOSS_SCALE: tl.constexpr):
    """M's tile in float32, plus the error memory's tile with ``WITH_ERROR`` (project: every element's; project_t:
    the padding's), times the loss scale ``scale`` (loaded once per program) with ``LOSS_SCALE``."""
    x = x_raw.to(tl.float32)
    if WITH_ERROR:
        e = e_raw.to(tl.float32)
        if LOSS_SCALE:
            e = e * scale
        x += e
    return x


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


# The aligned kernels' stores of 2-byte values: the GPU's own rounding conversion (``cvt.rn``: round to nearest
# even, overflow to inf, one instruction for two bfloat16 values) instead of :func:`_cast_for_store`'s bit arithmetic
# (six instructions per element); the same bits for every finite value and inf, a NaN of the GPU's own encoding.
# Triton's interpreter truncates in ``.to(tl.bfloat16)``, so there the bit arithmetic stays.
HW_ROUNDING = tl.constexpr(not INTERPRETED)


@triton.jit
def _cast_rn(x, ptr):
    """float32 ``x`` -> ``ptr``'s element type, rounded to nearest even: the GPU's conversion when compiled
    (:data:`HW_ROUNDING`), :func:`_cast_for_store` in the interpreter."""
    if HW_ROUNDING:
        return x.to(ptr.dtype.element_ty)
    else:
        return _cast_for_store(x, ptr)


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


@triton.jit
def _bf16_head(x):
    """float32 ``x`` with the low 16 bits of its encoding cleared: its leading 8 significant bits, a bfloat16 value
    (``x`` truncated toward zero), as float32. ``x - _bf16_head(x)`` is exact in float32 (bit operations: the GPU and
    the interpreter, which truncates in ``.to(tl.bfloat16)``, give the same pieces)."""
    return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _dot_bf16_split(acc, a_raw, b):
    """``acc + a · b`` on tensor cores at the float32 ``ieee`` dot's accuracy: ``acc`` float32 ``[M, N]``, ``a_raw``
    a bfloat16 or float16 ``[M, K]`` tile (as loaded), ``b`` float32 ``[K, N]``; M, N, K >= 16 (``tl.dot``).

    ``b`` is split into three bfloat16 pieces, ``b = b_hi + b_mid + b_lo`` exactly (each the leading 8 bits of the
    remainder, :func:`_bf16_head`; 24 bits in all). A bfloat16 ``a`` is used as is (3 dots); a float16 ``a`` (11
    significant bits) is split into ``a_hi + a_lo``, both bfloat16, exactly (5 dots: the ``a_lo · b_lo`` term,
    below 2^-23 of ``|a| |b|``, is left out). Every product of two bfloat16 values is exact in float32 and the dots
    accumulate in float32, smallest terms first, so the result differs from a float32 FMA loop only in the order
    (and, on the GPU, the rounding inside a tensor-core instruction) of the sums. bfloat16 x bfloat16 with a float32
    accumulator is a tensor-core ``tl.dot`` on sm_80 (mma) and sm_90 (wgmma). Scheme: Henry, Tang, Heinecke,
    "Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision Computations", ARITH 2019
    (bf16x3 / bf16x6). A non-finite element of ``b`` makes its whole row of pieces non-finite (inf - inf): the result
    is non-finite where the float32 dot's is, but may be NaN where that one is inf. Range: the pieces are exactly
    bfloat16 for ``|b| >= 2^-110``; below, the third one falls under bfloat16's smallest subnormal (2^-133) and is
    rounded on the GPU, and with a float16 ``a`` the left-out ``a_lo · b_lo`` term is no longer small (subnormal
    ``b``). Such an element of an orthonormal P (unit-norm columns) adds below ``2^-110 |a|`` to a sum of order
    ``|a|`` (tests/ops/test_split_dot_pieces.py)."""
    b_hi = _bf16_head(b)
    rest = b - b_hi
    b_mid = _bf16_head(rest)
    b_lo = (rest - b_mid).to(SPLIT_OPERAND)
    b_mid = b_mid.to(SPLIT_OPERAND)
    b_hi = b_hi.to(SPLIT_OPERAND)
    if a_raw.dtype == tl.bfloat16:
        a = a_raw.to(SPLIT_OPERAND)
        acc = tl.dot(a, b_lo, acc, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(a, b_mid, acc, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(a, b_hi, acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        a32 = a_raw.to(tl.float32)
        a_hi = _bf16_head(a32)
        a_lo = (a32 - a_hi).to(SPLIT_OPERAND)
        a_hi = a_hi.to(SPLIT_OPERAND)
        acc = tl.dot(a_lo, b_mid, acc, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(a_lo, b_hi, acc, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_mid, acc, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_hi, acc, input_precision="ieee", out_dtype=tl.float32)
    return acc
