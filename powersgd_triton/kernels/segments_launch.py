"""Launchers of the elementwise bucket kernels: ``copy_segments`` (pack / unpack of the uncompressed
gradients), ``average`` (after the last all-reduce) and ``commit_factor`` (the standalone warm-start update).

One launch each for the whole bucket; shapes and dtypes as in :mod:`powersgd_triton.ops`.
"""

import torch

from ..layout import BucketLayout
from .launch_common import factor_columns
from .orthogonalize import _commit_factor_kernel
from .segments import _average_kernel, _copy_segments_kernel

SEGMENT_BLOCK = 1024
AVERAGE_BLOCK = 1024


def copy_segments(src, dst, layout: BucketLayout, to_packed: bool, scale: float = 1.0) -> None:
    """One launch: the uncompressed gradients, bucket -> packed buffer (``to_packed``) or packed -> bucket."""
    tiles = layout.segment_tiles(SEGMENT_BLOCK, to_packed)
    if tiles.shape[0] == 0:
        return
    _copy_segments_kernel[(tiles.shape[0],)](src, dst, tiles, float(scale), BLOCK=SEGMENT_BLOCK, num_warps=4)


def average(factor, layout: BucketLayout, which: str, buffer, unc, world_size: int):
    """One launch after the last all-reduce: ``factor /= world_size`` in place; ``unc / world_size`` into the
    bucket's uncompressed positions (``unc`` packed, or None when they are one range of ``buffer``, divided in
    place); returns ``(flags, first)``: uint8 step flags (bit 0 finite, bit 1 non-zero factor chunk) and the int32
    table of each matrix's flags, for :func:`reconstruct`."""
    packed = unc is not None
    tiles, first = layout.average_tiles(which, packed, AVERAGE_BLOCK)
    flags = torch.empty(tiles.shape[0], dtype=torch.uint8, device=buffer.device)
    if tiles.shape[0]:
        _average_kernel[(tiles.shape[0],)](
            factor, unc if packed else buffer, buffer, flags, tiles, float(world_size), BLOCK=AVERAGE_BLOCK,
            num_warps=4,
        )
    return flags, first


def commit_factor(new, kept, layout: BucketLayout, which: str, ok) -> None:
    """One launch: ``kept_i <- new_i`` for every matrix whose new factor is not all zero, if ``ok`` (device flag)."""
    columns = factor_columns(which)
    flag = ok.reshape(1)
    if flag.dtype == torch.bool:
        flag = flag.view(torch.uint8)
    _commit_factor_kernel[(layout.num_matrices,)](
        new, kept, flag, layout.table, **columns, BLOCK=256, num_warps=4
    )
