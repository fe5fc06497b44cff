"""Uncompressed gradients and the end of a step, one launch each.

:func:`_copy_segments_kernel`: gather / scatter of the uncompressed gradients of a bucket (biases, norms, small
matrices: a few ragged segments of the bucket buffer). One program copies one chunk of at most ``BLOCK`` contiguous
elements, from a host-built ``int64`` tile table ``(source offset, destination offset, count)``, multiplying by
``scale`` and casting to the destination dtype (float32 upcasts are exact; downcasts round to nearest even).
:func:`_pack_rows`: the same gather inside project's launch (the layer-wise hook's step packs there, one launch
less; :mod:`powersgd_triton.ops.projection`), one chunk per warp of its program.

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
    AVERAGE_COUNT, AVERAGE_DST, AVERAGE_MAT, AVERAGE_SRC, AVERAGE_TILE_WIDTH, RANK, TABLE_WIDTH, _cast_for_store, _cast_rn, loop_range,
)
from powersgd_triton.ops.launch import DirectLaunch, factor_columns

# copy_segments: one warp per program, SEGMENT_BLOCK elements per sub-block (8 per thread: one 16-byte access of a
# 2-byte dtype, two of float32). The uncompressed gradients are short segments (ResNet-50's normalization
# parameters: 64-2048 elements each, one chunk per segment), and a program issues its loop's instructions per warp
# whatever its chunk's length: at 4 warps x 1024 elements a 128-element chunk cost the instructions of 4096
# (the kernel report: bf16 ResNet-50 0.52 warp instructions per element, issue ratio 0.54); a full chunk costs the
# same per element either way.
SEGMENT_BLOCK = 256
SEGMENT_WARPS = 1
AVERAGE_BLOCK = 1024
# Sub-blocks of SEGMENT_BLOCK / AVERAGE_BLOCK elements one program of copy_segments / average walks (an unrolled
# loop): a program's fixed work (its table row, average's flag reductions) is paid once per ITERS x BLOCK elements.
# sm_90, triton 3.9, 4 warps: 4 keeps average at 46-56 registers and 16-byte accesses.
SEGMENT_ITERS = 4
AVERAGE_ITERS = 4


def copy_segments(src, dst, layout: BucketLayout, to_packed: bool, scale: float = 1.0) -> None:
    """One launch: the uncompressed gradients, bucket -> packed buffer (``to_packed``) or packed -> bucket."""
    key = ("launch:copy_segments", bool(to_packed))
    plan = layout._tiles.get(key)
    if plan is None:
        plan = layout.memo(key, lambda: _segments_launch(layout, to_packed))
    launch, tiles = plan
    if launch is not None:
        launch(src, dst, tiles, float(scale))


def pack_chunks(layout: BucketLayout, rows: int) -> torch.Tensor:
    """The chunk table of the pack (:func:`_tables.segment_tiles`, bucket -> packed buffer, chunks of
    ``SEGMENT_BLOCK * SEGMENT_ITERS`` elements: the standalone pack's) padded with empty chunks (count 0) to a multiple
    of ``rows``: the table of :func:`_pack_rows` when ``rows`` chunks make one program (project's pack programs,
    :mod:`powersgd_triton.ops.projection`). Cached with the layout."""
    key = ("pack_chunks", int(rows))
    t = layout._tiles.get(key)
    if t is None:
        t = _tables.segment_tiles(layout, SEGMENT_BLOCK * SEGMENT_ITERS, True)
        pad = -t.shape[0] % rows
        if pad:
            t = torch.cat([t, t.new_zeros((pad, 3))])
        layout._tiles[key] = t
    return t


def _segments_launch(layout, to_packed):
    tiles = _tables.segment_tiles(layout, SEGMENT_BLOCK * SEGMENT_ITERS, to_packed)
    if tiles.shape[0] == 0:
        return None, tiles
    align = chunk_alignment(layout)
    return DirectLaunch(_copy_segments_kernel, (tiles.shape[0],), dict(
        BLOCK=SEGMENT_BLOCK, ITERS=SEGMENT_ITERS, ALIGN=align, num_warps=SEGMENT_WARPS)), tiles


# The element counts the chunks of the elementwise launches are checked against (chunk_alignment): 16 bytes of the
# narrowest dtype they may move (2-byte gradients or factors), so that every tensor of the launch is accessed 16 bytes
# at a time wherever its own pointer is 16-byte aligned.
CHUNK_ALIGN = 8


def chunk_alignment(layout: BucketLayout, which: str = "") -> int:
    """``CHUNK_ALIGN`` when every chunk of the uncompressed segments (and, with ``which`` "p" or "q", of that factor
    of every matrix) starts at a multiple of it in every buffer it is read from or written to and holds a multiple of
    it, else 0: the ``ALIGN`` constexpr of :func:`_copy_segments_kernel` (``which=""``) and :func:`_average_kernel`,
    whose offsets and counts are then declared multiples of it (16-byte accesses). From the layout alone (chunks of
    ``SEGMENT_BLOCK`` / ``AVERAGE_BLOCK``, multiples of it, start where their segment does)."""
    key = ("chunk_alignment", which)
    if key not in layout._tiles:
        spans = [(off, n) for off, n in layout.uncompressed]  # packed positions are sums of the lengths
        for s in layout.matrices if which else ():
            spans.append((s.p_offset, s.n * s.rank) if which == "p" else (s.q_offset, s.m * s.rank))
        ok = all(off % CHUNK_ALIGN == 0 and n % CHUNK_ALIGN == 0 for off, n in spans)
        layout._tiles[key] = CHUNK_ALIGN if ok else 0
    return layout._tiles[key]


def average(factor, layout: BucketLayout, which: str, buffer, unc, world_size: int, out=None):
    """One launch after the last all-reduce: ``factor / world_size`` into ``out`` (default: ``factor``, in place;
    ``factor`` may be in the communication dtype it was all-reduced in, ``out`` the memory's float32 factor);
    ``unc / world_size`` into the bucket's uncompressed positions (``unc`` packed, or None when they are one range
    of ``buffer``, divided in place); returns ``(flags, first)``: uint8 step flags (bit 0 finite, bit 1 non-zero
    factor chunk) and the int32 table of each matrix's flags, for :func:`powersgd_triton.ops.reconstruction.reconstruct`. The flags are the launch's
    one allocation."""
    packed = unc is not None
    recip = world_size & (world_size - 1) == 0  # a power of two: x * (1 / w) is x / w, bit for bit
    key = ("launch:average", which, packed, recip)
    plan = layout._tiles.get(key)
    if plan is None:
        plan = layout.memo(key, lambda: _average_launch(layout, which, packed, recip))
    launch, tiles, first = plan
    flags = torch.empty(tiles.shape[0], dtype=torch.uint8, device=buffer.device)
    if launch is not None:
        launch(factor, factor if out is None else out, unc if packed else buffer, buffer, flags, tiles,
               1.0 / world_size if recip else float(world_size))
    return flags, first


def average_bound(factor, layout: BucketLayout, which: str, buffer, packed: bool, world_size: int, out=None):
    """``(average, n_flags, first)``: ``average(unc) -> flags`` makes the launch :func:`average` makes with these
    arguments and ``unc`` (the packed uncompressed gradients when ``packed``, else None), allocating the step flags
    as it does (the plan and the other arguments bound now; the hooks' step plans); ``n_flags`` the flags' count,
    ``first`` the int32 table of each matrix's flags."""
    recip = world_size & (world_size - 1) == 0
    key = ("launch:average", which, packed, recip)
    plan = layout._tiles.get(key)
    if plan is None:
        plan = layout.memo(key, lambda: _average_launch(layout, which, packed, recip))
    launch, tiles, first = plan
    n, device = tiles.shape[0], buffer.device
    fo = factor if out is None else out
    w = 1.0 / world_size if recip else float(world_size)
    empty, uint8 = torch.empty, torch.uint8

    def average_step(unc):
        flags = empty(n, dtype=uint8, device=device)
        if launch is not None:
            launch(factor, fo, unc if packed else buffer, buffer, flags, tiles, w)
        return flags

    return average_step, n, first


def _average_launch(layout, which, packed, recip):
    tiles, first = _tables.average_tiles(layout, which, packed, AVERAGE_BLOCK * AVERAGE_ITERS)
    launch = None
    if tiles.shape[0]:
        align = chunk_alignment(layout, which)
        launch = DirectLaunch(_average_kernel, (tiles.shape[0],), dict(
            BLOCK=AVERAGE_BLOCK, ITERS=AVERAGE_ITERS, ALIGN=align, RECIP=recip, num_warps=4))
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
    tiles_ptr,  # int64 [T, 3] (source offset, destination offset, count <= ITERS x BLOCK)
    scale,  # float32 factor applied on the way
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr = 1,  # sub-blocks of BLOCK elements per program at most (the tile table's chunks)
    ALIGN: tl.constexpr = 0,  # offsets and counts are multiples of ALIGN elements (chunk_alignment): 16-byte accesses
):
    pid = tl.program_id(0).to(tl.int64)
    if ALIGN:
        src0 = tl.multiple_of(tl.load(tiles_ptr + 3 * pid), ALIGN)
        dst0 = tl.multiple_of(tl.load(tiles_ptr + 3 * pid + 1), ALIGN)
        count = tl.multiple_of(tl.load(tiles_ptr + 3 * pid + 2).to(tl.int32), ALIGN)
        offs = tl.arange(0, BLOCK)
    else:
        src0 = tl.load(tiles_ptr + 3 * pid)
        dst0 = tl.load(tiles_ptr + 3 * pid + 1)
        count = tl.load(tiles_ptr + 3 * pid + 2)
        offs = tl.arange(0, BLOCK).to(tl.int64)
    sp = src_ptr + src0  # this chunk's pointers: 32-bit offsets inside the loop
    dp = dst_ptr + dst0
    for o0 in loop_range(0, count, BLOCK):  # at most ITERS sub-blocks
        o = offs + o0
        mask = o < count
        x = tl.load(sp + o, mask=mask, other=0.0).to(tl.float32) * scale
        if ALIGN:
            tl.store(dp + o, _cast_rn(x, dp), mask=mask)
        else:
            tl.store(dp + o, _cast_for_store(x, dp), mask=mask)


@triton.jit
def _pack_rows(
    src_ptr,  # the bucket buffer
    dst_ptr,  # the packed buffer
    chunks_ptr,  # int64 [G x ROWS, 3] (source offset, destination offset, count): pack_chunks
    group,  # which ROWS chunks: rows group x ROWS ... group x ROWS + ROWS - 1 of the table
    ROWS: tl.constexpr,  # chunks per program: one per row of the [ROWS, BLOCK] tile (project's num_warps: a warp each)
    BLOCK: tl.constexpr,  # elements per row and loop trip (SEGMENT_BLOCK: 8 per thread of a warp)
    ALIGN: tl.constexpr = 0,  # offsets and counts are multiples of ALIGN elements (chunk_alignment): 16-byte accesses
):
    """The pack of ``ROWS`` chunks of the uncompressed segments in one program (project's pack programs): a
    ``[ROWS, BLOCK]`` tile, one chunk per row, each row masked by its own count, looping while the longest of the
    ``ROWS`` chunks has elements left (short chunks cost one trip). The values are copied as they are when the
    packed buffer has the bucket's dtype (the hooks': the torch backend's ``index_select``, and for every finite
    value the standalone pack's copy with scale 1, bit for bit), else upcast to float32 and rounded to the
    destination dtype as :func:`_copy_segments_kernel` does."""
    idx = group.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row = chunks_ptr + 3 * idx
    if ALIGN:
        src0 = tl.multiple_of(tl.load(row), ALIGN)
        dst0 = tl.multiple_of(tl.load(row + 1), ALIGN)
        count = tl.multiple_of(tl.load(row + 2).to(tl.int32), ALIGN)
        offs = tl.arange(0, BLOCK)
    else:
        src0 = tl.load(row)
        dst0 = tl.load(row + 1)
        count = tl.load(row + 2)
        offs = tl.arange(0, BLOCK).to(tl.int64)
    sp = src_ptr + src0[:, None]  # each row's pointers: 32-bit offsets inside the loop (ALIGN)
    dp = dst_ptr + dst0[:, None]
    end = count[:, None]
    for o0 in loop_range(0, tl.max(count, axis=0), BLOCK):
        o = offs[None, :] + o0
        mask = o < end
        x = tl.load(sp + o, mask=mask, other=0.0)
        if dst_ptr.dtype.element_ty == src_ptr.dtype.element_ty:
            tl.store(dp + o, x, mask=mask)
        elif ALIGN:
            tl.store(dp + o, _cast_rn(x.to(tl.float32), dp), mask=mask)
        else:
            tl.store(dp + o, _cast_for_store(x.to(tl.float32), dp), mask=mask)


@triton.jit
def _average_kernel(
    f_ptr,  # flat all-reduced factor (P or Q): float32, or the communication dtype it was all-reduced in
    fo_ptr,  # where the averaged factor goes (float32): f_ptr itself (in place), or the memory's factor
    src_ptr,  # all-reduced uncompressed gradients (packed buffer, or the bucket itself)
    dst_ptr,  # the bucket buffer
    flags_ptr,  # uint8 [T] output flags
    tiles_ptr,  # int64 [T, AVERAGE_TILE_WIDTH] (matrix or -1: uncompressed, source offset, destination offset, count)
    world,  # float32 world size (RECIP: its reciprocal)
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr = 1,  # sub-blocks of BLOCK elements per program (a chunk holds at most ITERS x BLOCK)
    ALIGN: tl.constexpr = 0,  # offsets and counts are multiples of ALIGN elements (chunk_alignment): 16-byte accesses
    RECIP: tl.constexpr = False,  # the world size is a power of two: multiply by its (exact) reciprocal
):
    """One chunk per program: the factor's (``matrix >= 0``: in place into ``fo_ptr``, flag bits 0 finite and 1
    non-zero) or the uncompressed gradients' (into the bucket, flag bit 0), divided by the world size as IEEE
    division rounds (``tl.div_rn``; a power-of-two world size multiplies by its reciprocal, which is the same
    number), ``ITERS`` sub-blocks of ``BLOCK`` elements."""
    pid = tl.program_id(0).to(tl.int64)
    mat = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_MAT)
    if ALIGN:
        src0 = tl.multiple_of(tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_SRC), ALIGN)
        dst0 = tl.multiple_of(tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_DST), ALIGN)
        count = tl.multiple_of(tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_COUNT).to(tl.int32), ALIGN)
        offs = tl.arange(0, BLOCK)
    else:
        src0 = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_SRC)
        dst0 = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_DST)
        count = tl.load(tiles_ptr + AVERAGE_TILE_WIDTH * pid + AVERAGE_COUNT)
        offs = tl.arange(0, BLOCK).to(tl.int64)
    # in-thread accumulators, reduced once: x * 0 summed (0, or NaN once an element is not finite), max |y|
    nan_sum = tl.zeros((BLOCK,), tl.float32)
    peak = tl.zeros((BLOCK,), tl.float32)
    fp = f_ptr + src0  # this chunk's pointers: 32-bit offsets inside the loop
    fop = fo_ptr + src0
    sp = src_ptr + src0
    dp = dst_ptr + dst0
    if mat >= 0:
        for o0 in loop_range(0, count, BLOCK):  # at most ITERS sub-blocks
            o = offs + o0
            mask = o < count
            x = tl.load(fp + o, mask=mask, other=0.0).to(tl.float32)
            if RECIP:
                y = x * world
            else:
                y = tl.div_rn(x, tl.zeros_like(x) + world)
            tl.store(fop + o, _cast_for_store(y, fop), mask=mask)
            nan_sum += x * 0.0
            peak = tl.maximum(peak, tl.abs(y), propagate_nan=tl.PropagateNan.ALL)
        finite = (tl.sum(nan_sum, axis=0) == 0.0).to(tl.int32)
        flag = finite | ((tl.max(peak, axis=0) != 0.0).to(tl.int32) << 1)
    else:
        for o0 in loop_range(0, count, BLOCK):  # at most ITERS sub-blocks
            o = offs + o0
            mask = o < count
            x = tl.load(sp + o, mask=mask, other=0.0).to(tl.float32)
            if RECIP:
                y = x * world
            else:
                y = tl.div_rn(x, tl.zeros_like(x) + world)
            if ALIGN:
                tl.store(dp + o, _cast_rn(y, dp), mask=mask)
            else:
                tl.store(dp + o, _cast_for_store(y, dp), mask=mask)
            nan_sum += x * 0.0
        flag = (tl.sum(nan_sum, axis=0) == 0.0).to(tl.int32)
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
