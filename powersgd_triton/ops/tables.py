"""The kernel tables: the columns of every table the kernels read, and the tile tables of the streaming and
elementwise launches, built once per layout and kept with it (:meth:`~powersgd_triton.layout.BucketLayout.memo`'s
store).

The layout table (:attr:`powersgd_triton.layout.BucketLayout.table`, one row of :data:`TABLE_COLUMNS` per matrix)
says what a bucket is; its columns are re-exported here so that the kernels' constexprs
(:mod:`powersgd_triton.ops.common`) read every table format from one place. The tile and task tables hold one row
per program of a launch: :func:`tiles` (project), :func:`project_t_tiles` (project_t and its reduce_splits),
:func:`reconstruct_tiles`, :func:`average_tiles`, :func:`segment_tiles` (copy_segments) and orthogonalize's task
tables (``ORTHO_*_COLUMNS``, built by :class:`powersgd_triton.ops.orthogonalization._OrthoPlan`).
"""

from typing import Optional

import numpy as np
import torch

# the layout table's format, re-exported with the others (the kernels' constexprs read every table from here)
from powersgd_triton.layout import (  # noqa: F401
    COLS, E_OFF, NUMEL, OFF, P_OFF, Q_OFF, RANK, ROWS, TABLE_COLUMNS, TABLE_WIDTH, BucketLayout, table_row,
)

# Columns of the tile tables: one row per program of a launch, built (and cached with the layout) by the function
# named. The kernels read them through the constexprs of powersgd_triton.ops.common; each table has its own names.
# project: tiles("rows", BLOCK_N), int32 (T, 2).
TILE_COLUMNS = ("matrix", "first")  # first row ("rows") or column ("cols") of the tile
TILE_MAT, TILE_FIRST = range(2)
TILE_WIDTH = len(TILE_COLUMNS)
# project_t: project_t_tiles(...)[0], int32 (T, 5); workspace offset -1: the program writes Q itself.
PROJECT_T_TILE_COLUMNS = ("matrix", "first_col", "first_row", "end_row", "ws_offset")
PROJECT_T_MAT, PROJECT_T_COL0, PROJECT_T_ROW0, PROJECT_T_ROW_END, PROJECT_T_WS_OFF = range(5)
PROJECT_T_TILE_WIDTH = len(PROJECT_T_TILE_COLUMNS)
# reduce_splits (the second launch of project_t for split matrices): project_t_tiles(...)[1], int32 (T, 4).
REDUCE_TILE_COLUMNS = ("matrix", "first_col", "ws_offset", "splits")
REDUCE_MAT, REDUCE_COL0, REDUCE_WS_OFF, REDUCE_SPLITS = range(4)
REDUCE_TILE_WIDTH = len(REDUCE_TILE_COLUMNS)
# reconstruct: reconstruct_tiles(...), int32 (T, 4).
RECON_TILE_COLUMNS = ("matrix", "first_row", "first_col", "end_col")
RECON_MAT, RECON_ROW0, RECON_COL0, RECON_COL_END = range(4)
RECON_TILE_WIDTH = len(RECON_TILE_COLUMNS)
# average: average_tiles(...)[0], int64 (T, 4); matrix -1: an uncompressed chunk.
AVERAGE_TILE_COLUMNS = ("matrix", "src_offset", "dst_offset", "count")
AVERAGE_MAT, AVERAGE_SRC, AVERAGE_DST, AVERAGE_COUNT = range(4)
AVERAGE_TILE_WIDTH = len(AVERAGE_TILE_COLUMNS)

# orthogonalize's task tables (orthogonalization._OrthoPlan), int64. orthogonalize_gram: one program per GRAM_ROWS rows of a
# tall factor; "slot": its Gram partial's slot in the float64 workspace, "head_slot": the matrix's head slot (-1 but
# in the first task), "completion": completion vectors (the smallest power of two >= the matrix's rank).
ORTHO_GRAM_TASK_COLUMNS = ("matrix", "first_row", "slot", "head_slot", "completion", "rows", "rank", "offset")
GRAM_MAT, GRAM_ROW0, GRAM_SLOT, GRAM_HEAD, GRAM_RM, GRAM_N, GRAM_R, GRAM_OFF = range(8)
ORTHO_GRAM_TASK_WIDTH = len(ORTHO_GRAM_TASK_COLUMNS)
# orthogonalize: one program per short factor (rows 0..end, no slots: "slots" 0, "head_slot" -1) or per SPLIT_ROWS
# rows of a tall one ("first_slot".."first_slot" + "slots": its Gram partials). Both tables also carry the factor's
# row count, rank and offset in the flat factor ("rows", "rank", "offset"), so that a program reads its whole
# task in one load instead of following "matrix" into the layout table (one DRAM latency less per program).
ORTHO_TASK_COLUMNS = ("matrix", "first_row", "end_row", "first_slot", "slots", "head_slot", "completion", "rows",
                      "rank", "offset")
ORTHO_MAT, ORTHO_ROW0, ORTHO_ROW_END, ORTHO_SLOT0, ORTHO_SLOTS, ORTHO_HEAD, ORTHO_RM, ORTHO_N, ORTHO_R, ORTHO_OFF = (
    range(10))
ORTHO_TASK_WIDTH = len(ORTHO_TASK_COLUMNS)


def tiles(layout: BucketLayout, kind: str, block: int) -> torch.Tensor:
    """Device ``int32`` table of shape ``(T, 2)``: ``(matrix index, first row or column)`` of each tile
    (:data:`TILE_COLUMNS`).

    ``kind="rows"`` tiles every M_i into blocks of ``block`` rows (project, reconstruct); ``kind="cols"`` into
    blocks of ``block`` columns (project_t). Cached per (kind, block).
    """
    key = (kind, int(block))
    t = layout._tiles.get(key)
    if t is None:
        if kind not in ("rows", "cols"):
            raise ValueError(f"unknown tile kind {kind!r}")
        mats, starts = [], []
        for i, s in enumerate(layout.matrices):
            extent = s.n if kind == "rows" else s.m
            count = -(-extent // block)
            mats.append(np.full(count, i, dtype=np.int32))
            starts.append(np.arange(count, dtype=np.int64) * block)
        if mats:
            arr = np.zeros((sum(len(x) for x in mats), TILE_WIDTH), dtype=np.int32)
            arr[:, TILE_MAT] = np.concatenate(mats)
            arr[:, TILE_FIRST] = np.concatenate(starts)
        else:
            arr = np.zeros((0, TILE_WIDTH), dtype=np.int32)
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(layout.device)
        layout._tiles[key] = t
    return t


def project_t_tiles(layout: BucketLayout, block: int, split_rows: int = 0, reduce_block: Optional[int] = None):
    """Tile tables of project_t for ``block`` columns per tile and at most ``split_rows`` rows per program.

    Returns ``(tiles, reduce_tiles, workspace_numel)``: ``tiles`` is a device ``int32 (T, 5)`` table
    (:data:`PROJECT_T_TILE_COLUMNS`: matrix, first column, first row, end row, workspace offset or -1);
    matrices with ``n > split_rows`` (when ``split_rows > 0``) are split over rows and write partial sums to a
    float32 workspace of ``workspace_numel`` elements, which the reduce_splits launch sums in a fixed order from
    ``reduce_tiles`` (``int32 (T2, 4)``, :data:`REDUCE_TILE_COLUMNS`: matrix, first column, workspace offset,
    number of splits; one per ``reduce_block`` columns of a split matrix, default ``block``; None when nothing
    is split). Cached per arguments. Raises ``ValueError`` when the workspace would exceed int32 offsets.
    """
    reduce_block = int(reduce_block or block)
    key = ("cols5", int(block), int(split_rows), reduce_block)
    cached = layout._tiles.get(key)
    if cached is None:
        tiles, reduce_tiles = [], []
        ws = 0

        def tile(mat, col0, row0, row_end, ws_off):
            return table_row(PROJECT_T_TILE_WIDTH, {PROJECT_T_MAT: mat, PROJECT_T_COL0: col0,
                                                     PROJECT_T_ROW0: row0, PROJECT_T_ROW_END: row_end,
                                                     PROJECT_T_WS_OFF: ws_off})

        for i, s in enumerate(layout.matrices):
            nsplit = -(-s.n // split_rows) if split_rows > 0 and s.n > split_rows else 1
            for c in range(0, s.m, block):
                if nsplit == 1:
                    tiles.append(tile(i, c, 0, s.n, -1))
                else:
                    for k in range(nsplit):
                        end = min(s.n, (k + 1) * split_rows)
                        tiles.append(tile(i, c, k * split_rows, end, ws + k * s.m * s.rank))
            if nsplit > 1:
                for c in range(0, s.m, reduce_block):
                    reduce_tiles.append(table_row(REDUCE_TILE_WIDTH, {REDUCE_MAT: i, REDUCE_COL0: c,
                                                                       REDUCE_WS_OFF: ws, REDUCE_SPLITS: nsplit}))
                ws += nsplit * s.m * s.rank
        if ws >= 2**31:
            raise ValueError("project_t workspace exceeds int32 offsets; use a larger split_rows")

        def dev(rows, width):
            return torch.tensor(rows, dtype=torch.int32).reshape(-1, width).to(layout.device)

        cached = (dev(tiles, PROJECT_T_TILE_WIDTH), dev(reduce_tiles, REDUCE_TILE_WIDTH) if reduce_tiles else None,
                  ws)
        layout._tiles[key] = cached
    return cached


def reconstruct_tiles(layout: BucketLayout, block: int, split_cols: int = 0) -> torch.Tensor:
    """Tile table of reconstruct: device ``int32 (T, 4)`` (:data:`RECON_TILE_COLUMNS`: matrix, first row, first
    column, end column), ``block`` rows per tile and at most ``split_cols`` columns per program (0: whole
    rows). Cached."""
    key = ("rows4", int(block), int(split_cols))
    t = layout._tiles.get(key)
    if t is None:
        rows = []
        for i, s in enumerate(layout.matrices):
            chunk = split_cols if 0 < split_cols < s.m else s.m
            for r0 in range(0, s.n, block):
                for c in range(0, s.m, chunk):
                    rows.append(table_row(RECON_TILE_WIDTH, {RECON_MAT: i, RECON_ROW0: r0, RECON_COL0: c,
                                                              RECON_COL_END: min(s.m, c + chunk)}))
        t = torch.tensor(rows, dtype=torch.int32).reshape(-1, RECON_TILE_WIDTH).to(layout.device)
        layout._tiles[key] = t
    return t


def average_tiles(layout: BucketLayout, which: str, packed: bool, block: int):
    """Tile tables of the average launch: ``(tiles, first)``.

    ``tiles``: device ``int64 (T, 4)`` (:data:`AVERAGE_TILE_COLUMNS`: matrix or -1, source offset, destination
    offset, count <= block):
    first the factor (``which`` = "p" or "q") of every matrix in chunks of ``block`` (source = destination, in
    place), then the uncompressed gradients: from a packed buffer (``packed``) into their bucket positions, or in
    place in the bucket (one range or none). ``first``: device ``int32 (L + 1,)``, the factor chunks of matrix i
    are rows ``first[i]:first[i + 1]``. Cached.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    if packed is False and len(layout.uncompressed) > 1:
        raise ValueError("uncompressed gradients in several ranges must be packed")
    key = ("average", which, bool(packed), int(block))
    cached = layout._tiles.get(key)
    if cached is None:
        rows, first = [], [0]
        for i, s in enumerate(layout.matrices):
            start = s.p_offset if which == "p" else s.q_offset
            count = (s.n if which == "p" else s.m) * s.rank
            for c in range(0, count, block):
                rows.append(table_row(AVERAGE_TILE_WIDTH, {AVERAGE_MAT: i, AVERAGE_SRC: start + c,
                                                            AVERAGE_DST: start + c,
                                                            AVERAGE_COUNT: min(block, count - c)}))
            first.append(len(rows))
        pos = 0
        for off, n in layout.uncompressed:
            for c in range(0, n, block):
                src = (pos if packed else off) + c
                rows.append(table_row(AVERAGE_TILE_WIDTH, {AVERAGE_MAT: -1, AVERAGE_SRC: src, AVERAGE_DST: off + c,
                                                            AVERAGE_COUNT: min(block, n - c)}))
            pos += n
        cached = (
            torch.tensor(rows, dtype=torch.int64).reshape(-1, AVERAGE_TILE_WIDTH).to(layout.device),
            torch.tensor(first, dtype=torch.int32).to(layout.device),
        )
        layout._tiles[key] = cached
    return cached


def segment_tiles(layout: BucketLayout, block: int, to_packed: bool) -> torch.Tensor:
    """Device ``int64 (T, 3)`` table ``(source offset, destination offset, count)`` of the uncompressed segments
    in chunks of at most ``block`` elements: bucket -> packed buffer (``to_packed``) or back. Cached."""
    key = ("segments", int(block), bool(to_packed))
    t = layout._tiles.get(key)
    if t is None:
        rows = []
        packed = 0
        for off, n in layout.uncompressed:
            for c in range(0, n, block):
                count = min(block, n - c)
                rows.append((off + c, packed + c, count) if to_packed else (packed + c, off + c, count))
            packed += n
        t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(layout.device)
        layout._tiles[key] = t
    return t
