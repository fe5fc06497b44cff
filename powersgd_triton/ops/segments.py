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
"""

import triton
import triton.language as tl

from powersgd_triton.ops.common import (
    AVERAGE_COUNT, AVERAGE_DST, AVERAGE_MAT, AVERAGE_SRC, AVERAGE_TILE_WIDTH, _cast_for_store,
)


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
