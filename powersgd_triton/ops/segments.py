"""Uncompressed gradients and the end of a step, one launch each.

:func:`_copy_segments_kernel`: gather / scatter of the uncompressed gradients of a bucket (biases, norms, small
matrices: a few ragged segments of the bucket buffer). One program copies one chunk of at most ``BLOCK`` contiguous
elements, from a host-built ``int64`` tile table ``(source offset, destination offset, count)``, multiplying by
``scale`` and casting to the destination dtype (float32 upcasts are exact; downcasts round to nearest even).

:func:`_average_kernel`: after the last all-reduce of a step, in one launch: divide the all-reduced factor by the
world size in place, divide the all-reduced uncompressed gradients by it and write them into the bucket (from a
packed buffer, or in place when they are one range of the bucket), and write one uint8 flag per program (bit 0: its
chunk is finite; bit 1: its chunk of the factor is not all zero after the division). ``reconstruct`` reads the flags:
it updates the error memory and commits the warm-start factor only when every flag has bit 0 (no host
synchronization), and commits a matrix's factor only when one of that matrix's flags has bit 1.

:func:`_commit_factor_kernel`: the standalone warm-start update (``kept_i <- new_i`` where the step is finite and
the new factor is not all zero).

The launchers :func:`copy_segments`, :func:`average` and :func:`commit_factor`: one launch each for the whole
bucket, plans kept with the layout; shapes and dtypes as in :mod:`powersgd_triton.ops`.
"""

import torch
import triton
import triton.language as tl

from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops import tables as _tables
from powersgd_triton.ops.common import (
    AVERAGE_COUNT, AVERAGE_DST, AVERAGE_MAT, AVERAGE_SRC, AVERAGE_TILE_WIDTH, RANK, TABLE_WIDTH, _cast_for_store, loop_range,
)
from powersgd_triton.ops.launch import DirectLaunch, factor_columns

SEGMENT_BLOCK = 1024
AVERAGE_BLOCK = 1024


def copy_segments(src, dst, layout: BucketLayout, to_packed: bool, scale: float = 1.0) -> None:
    """One launch: the uncompressed gradients, bucket -> packed buffer (``to_packed``) or packed -> bucket."""
    key = ("launch:copy_segments", bool(to_packed))
    plan = layout._tiles.get(key)
    if plan is None:
        plan = layout.memo(key, lambda: _segments_launch(layout, to_packed))
    launch, tiles = plan
    if launch is not None:
        launch(src, dst, tiles, float(scale))


def _segments_launch(layout, to_packed):
    tiles = _tables.segment_tiles(layout, SEGMENT_BLOCK, to_packed)
    if tiles.shape[0] == 0:
        return None, tiles
    return DirectLaunch(_copy_segments_kernel, (tiles.shape[0],), dict(BLOCK=SEGMENT_BLOCK, num_warps=4)), tiles


def average(factor, layout: BucketLayout, which: str, buffer, unc, world_size: int, out=None):
    """One launch after the last all-reduce: ``factor / world_size`` into ``out`` (default: ``factor``, in place;
    ``factor`` may be in the communication dtype it was all-reduced in, ``out`` the memory's float32 factor);
    ``unc / world_size`` into the bucket's uncompressed positions (``unc`` packed, or None when they are one range
    of ``buffer``, divided in place); returns ``(flags, first)``: uint8 step flags (bit 0 finite, bit 1 non-zero
    factor chunk) and the int32 table of each matrix's flags, for :func:`powersgd_triton.ops.reconstruction.reconstruct`. The flags are the launch's
    one allocation."""
    packed = unc is not None
    key = ("launch:average", which, packed)
    plan = layout._tiles.get(key)
    if plan is None:
        plan = layout.memo(key, lambda: _average_launch(layout, which, packed))
    launch, tiles, first = plan
    flags = torch.empty(tiles.shape[0], dtype=torch.uint8, device=buffer.device)
    if launch is not None:
        launch(factor, factor if out is None else out, unc if packed else buffer, buffer, flags, tiles,
               float(world_size))
    return flags, first


def _average_launch(layout, which, packed):
    tiles, first = _tables.average_tiles(layout, which, packed, AVERAGE_BLOCK)
    launch = None
    if tiles.shape[0]:
        launch = DirectLaunch(_average_kernel, (tiles.shape[0],), dict(BLOCK=AVERAGE_BLOCK, num_warps=4))
    return launch, tiles, first


def commit_factor(new, kept, layout: BucketLayout, which: str, ok) -> None:
    """One launch: ``kept_i <- new_i`` for every matrix whose new factor is not all zero, if ``ok`` (device flag)."""
    launch = layout.memo(("launch:commit_factor", which), lambda: DirectLaunch(
        _commit_factor_kernel, (layout.num_matrices,), dict(**factor_columns(which), BLOCK=256, num_warps=4)))
    flag = ok.reshape(1)
    if flag.dtype == torch.bool:
        flag = flag.view(torch.uint8)
    launch(new, kept, flag, layout.table)


@triton.jit
def _copy_segments_kernel(
    src_ptr,  # source buffer (bucket or packed buffer)
    dst_ptr,  # destination buffer
    tiles_ptr,  # int64 [T, 3] (source offset, destination offset, count <= BLOCK)
    scale,  # float32 factor applied on the way
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    src0 = tl.load(tiles_ptr + 3 * pid)
    dst0 = tl.load(tiles_ptr + 3 * pid + 1)
    count = tl.load(tiles_ptr + 3 * pid + 2)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < count
    x = tl.load(src_ptr + src0 + offs, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(dst_ptr + dst0 + offs, _cast_for_store(x, dst_ptr), mask=mask)


@triton.jit
def _average_kernel(
    f_ptr,  # flat all-reduced factor (P or Q): float32, or the communication dtype it was all-reduced in
    fo_ptr,  # where the averaged factor goes (float32): f_ptr itself (in place), or the memory's factor
    src_ptr,  # all-reduced uncompressed gradients (packed buffer, or the bucket itself)
    dst_ptr,  # the bucket buffer
    flags_ptr,  # uint8 [T] output flags
    tiles_ptr,  # int64 [T, AVERAGE_TILE_WIDTH] (matrix or -1: uncompressed, source offset, destination offset, count)
    world,  # float32 world size
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    mat = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_MAT)
    src0 = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_SRC)
    dst0 = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_DST)
    count = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_COUNT)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < count
    if mat >= 0:
        x = tl.load(f_ptr + src0 + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.div_rn(x, tl.zeros_like(x) + world)
        tl.store(fo_ptr + src0 + offs, _cast_for_store(y, fo_ptr), mask=mask)
        finite = tl.min((x * 0.0 == 0.0).to(tl.int32), axis=0)
        nonzero = tl.max((y != 0.0).to(tl.int32), axis=0)
        flag = finite | (nonzero << 1)
    else:
        x = tl.load(src_ptr + src0 + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.div_rn(x, tl.zeros_like(x) + world)
        tl.store(dst_ptr + dst0 + offs, _cast_for_store(y, dst_ptr), mask=mask)
        flag = tl.min((x * 0.0 == 0.0).to(tl.int32), axis=0)
    tl.store(flags_ptr + pid, flag.to(tl.uint8))


@triton.jit
def _commit_factor_kernel(
    new_ptr,  # flat factor of this step (float32)
    kept_ptr,  # flat factor kept between steps (float32), updated in place
    flag_ptr,  # uint8 flag: the step is finite (0: keep everything)
    table_ptr,  # int64 [L, TABLE_WIDTH] layout table
    ROWS_COL: tl.constexpr,  # layout-table column of the factor's row count (ROWS: n for P, COLS: m for Q)
    OFF_COL: tl.constexpr,  # layout-table column of the factor's offset (P_OFF, Q_OFF)
    BLOCK: tl.constexpr,
):
    """kept_i <- new_i for every matrix i whose new factor is not all zero, where the step is finite.

    One program per matrix: an exact max-abs reduction (order-independent), then a masked copy. A factor that is all
    zero (the layer had no gradient on any rank) is not kept: orth(0) = 0 and M·0 = 0 would zero it for good.
    """
    mat = tl.program_id(0).to(tl.int64)
    row = table_ptr + mat * TABLE_WIDTH
    count = tl.load(row + ROWS_COL) * tl.load(row + RANK)
    base = tl.load(row + OFF_COL)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in loop_range(0, count, BLOCK):
        x = tl.load(new_ptr + base + k0 + offs, mask=k0 + offs < count, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    # as a [BLOCK] mask: a scalar bool in a mask expression is not portable (the interpreter rejects it)
    nonzero = (tl.zeros((BLOCK,), dtype=tl.float32) + tl.max(peak, axis=0)) != 0.0
    ok = tl.load(flag_ptr + tl.zeros((BLOCK,), dtype=tl.int32)) != 0
    for k0 in loop_range(0, count, BLOCK):
        mask = k0 + offs < count
        x = tl.load(new_ptr + base + k0 + offs, mask=mask, other=0.0)
        tl.store(kept_ptr + base + k0 + offs, x, mask=mask & ok & nonzero)
