"""Gather / scatter of the uncompressed gradients of a bucket in one launch (alternating hook's single all-reduce).

The uncompressed gradients (biases, norms, small matrices) are a few ragged segments of the bucket buffer. One
program copies one chunk of at most ``BLOCK`` contiguous elements, from a host-built ``int64`` tile table
``(source offset, destination offset, count)``, multiplying by ``scale`` and casting to the destination dtype
(float32 upcasts are exact; downcasts round to nearest even).
"""

import triton
import triton.language as tl

from .lowrank_mm import _cast_for_store


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
