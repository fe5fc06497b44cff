"""Launchers of the elementwise bucket kernels: ``copy_segments`` (pack / unpack of the uncompressed
gradients), ``average`` (after the last all-reduce) and ``commit_factor`` (the standalone warm-start update).

One launch each for the whole bucket; shapes and dtypes as in :mod:`powersgd_triton.ops`.
"""

import torch

from powersgd_triton.compat.versions import DirectLaunch
from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops.launch_common import factor_columns
from powersgd_triton.ops.orthogonalization import _commit_factor_kernel
from powersgd_triton.ops.segments import _average_kernel, _copy_segments_kernel

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
    tiles = layout.segment_tiles(SEGMENT_BLOCK, to_packed)
    if tiles.shape[0] == 0:
        return None, tiles
    return DirectLaunch(_copy_segments_kernel, (tiles.shape[0],), dict(BLOCK=SEGMENT_BLOCK, num_warps=4)), tiles


def average(factor, layout: BucketLayout, which: str, buffer, unc, world_size: int, out=None):
    """One launch after the last all-reduce: ``factor / world_size`` into ``out`` (default: ``factor``, in place;
    ``factor`` may be in the communication dtype it was all-reduced in, ``out`` the memory's float32 factor);
    ``unc / world_size`` into the bucket's uncompressed positions (``unc`` packed, or None when they are one range
    of ``buffer``, divided in place); returns ``(flags, first)``: uint8 step flags (bit 0 finite, bit 1 non-zero
    factor chunk) and the int32 table of each matrix's flags, for :func:`reconstruct`. The flags are the launch's
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
    tiles, first = layout.average_tiles(which, packed, AVERAGE_BLOCK)
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
