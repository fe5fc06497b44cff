"""Bucket layouts: which gradients of a DDP bucket are compressed, where they live, and the kernel tables.

A DDP bucket is one flat 1-D buffer holding every gradient of the bucket back to back. PowerSGD views each
gradient as a matrix ``(shape[0], numel // shape[0])`` (PyTorch's ``tensor.view(shape[0], -1)``) and
compresses it when ``(n + m) * r * min_compression_rate < n * m`` (``_should_compress`` in PyTorch's hook).
A :class:`BucketLayout` records, once per bucket, for every compressed matrix M_i:

* its element offset ``o_i`` in the bucket buffer and its shape ``n_i x m_i``,
* its rank ``r_i = min(n_i, m_i, matrix_approximation_rank)``,
* the offsets of ``P_i`` (``n_i x r_i``), ``Q_i`` (``m_i x r_i``) and of its error memory (``n_i x m_i``) in three
  flat buffers,

plus the positions of the gradients that are all-reduced uncompressed. The P/Q packing order is PyTorch's: matrices
grouped by shape in order of first appearance (``shape_to_tensors`` in ``powerSGD_hook``), so our P/Q memory holds the
same numbers in the same places as PyTorch's ``p_memory_dict`` / ``q_memory_dict``.

The kernels read one small ``int64`` device table (:attr:`BucketLayout.table`, one row of :data:`TABLE_COLUMNS` per
matrix) and, per launch, a tile table with one row per program (``*_TILE_COLUMNS`` below: :meth:`BucketLayout.tiles`,
:meth:`~BucketLayout.project_t_tiles`, :meth:`~BucketLayout.reconstruct_tiles`, :meth:`~BucketLayout.average_tiles`),
all built once and cached. The batched view (``batched_powerSGD_hook``) is a layout with a single virtual ``s x s``
matrix, ``s = ceil(sqrt(N))``, whose elements past ``N`` are masked (``NUMEL`` column), so the bucket is never
resized. As in PyTorch's batched hook, the error memory covers the whole padded matrix (``s * s`` floats, at most
``2s - 1`` more than the bucket): the padding's ``M + E`` is its error memory.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# Columns of BucketLayout.table (int64, one row per compressed matrix, in P/Q packing order).
OFF, ROWS, COLS, NUMEL, RANK, P_OFF, Q_OFF, E_OFF = range(8)
TABLE_COLUMNS = ("offset", "n", "m", "numel", "rank", "p_offset", "q_offset", "e_offset")
TABLE_WIDTH = len(TABLE_COLUMNS)

# Columns of the tile tables: one row per program of a launch, built (and cached) by the BucketLayout method named.
# The kernels read them through the constexprs of powersgd_triton.ops.common; each table has its own names.
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

# orthogonalize's task tables (triton_ops._OrthoPlan), int64. orthogonalize_gram: one program per GRAM_ROWS rows of a
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

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The bucket kernels that take a block-size config (tuned per shape class; the other launches are fixed).
KERNELS = ("project", "orthogonalize", "project_t", "reconstruct")
MIN_DOT_RANK = 16  # tl.dot needs every dim >= 16 for 16-bit inputs on NVIDIA; R is padded to this when USE_DOT.


def padded_rank(max_rank: int, use_dot: bool = False) -> int:
    """The kernels' constexpr ``R`` for a bucket whose largest rank is ``max_rank``: rounded up to a power of two
    (>= :data:`MIN_DOT_RANK` with ``tl.dot``). Also the rank of the autotuner's shape classes."""
    r = 1
    while r < max(1, int(max_rank)):
        r *= 2
    return max(r, MIN_DOT_RANK) if use_dot else r


def check_gradient_dtype(dtype: torch.dtype) -> None:
    """Raise ``TypeError`` for gradient dtypes PowerSGD cannot compress (complex, integer, bool, fp64 is allowed).

    Complex gradients would need the conjugate transpose and integer ones cannot be averaged; PyTorch's hook fails
    on them deep inside ``bmm`` after it has already changed its state, we refuse them up front.
    """
    if dtype in SUPPORTED_DTYPES or dtype == torch.float64:
        return
    raise TypeError(
        f"PowerSGD compresses floating-point gradients (float32, float16, bfloat16, float64); got {dtype}. "
        "Complex and integer gradients are not supported."
    )


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> Tuple[bool, int, int]:
    """PyTorch's compression test: compress iff ``(n + m) * rank * min_compression_rate < n * m``.

    Returns ``(compress, uncompressed_numel, compressed_numel)`` with ``compressed_numel = (n + m) * rank``,
    the statistics ``PowerSGDState.compression_stats()`` accumulates (PyTorch ``_should_compress``).
    """
    uncompressed = n * m
    compressed = (n + m) * rank
    return compressed * min_compression_rate < uncompressed, uncompressed, compressed


@dataclass(frozen=True)
class MatrixSpec:
    """One compressed matrix of a bucket. All offsets and sizes are in elements, not bytes."""

    grad_index: int  # position in bucket.gradients() (-1 for the batched view)
    offset: int  # start of M_i in the bucket buffer
    n: int
    m: int
    numel: int  # valid elements of M_i (n*m, or N for the padded batched view)
    rank: int  # r_i = min(n, m, matrix_approximation_rank)
    p_offset: int
    q_offset: int
    e_offset: int


@dataclass(frozen=True)
class ShapeGroup:
    """Consecutive matrices of one shape: their P (and Q) form one contiguous ``(B, n, r)`` block."""

    n: int
    m: int
    rank: int
    first: int  # index into BucketLayout.matrices
    count: int

    @property
    def p_size(self) -> int:
        return self.count * self.n * self.rank

    @property
    def q_size(self) -> int:
        return self.count * self.m * self.rank


def matrix_segment(grad: torch.Tensor, buffer: torch.Tensor) -> Optional[int]:
    """Element offset of ``grad`` in ``buffer`` if ``grad`` is a dense view whose dim 0 is outermost, else None.

    Such a view is a row-major ``(shape[0], numel/shape[0])`` matrix in memory whatever the order of its inner dims
    (a channels-last conv weight is a column permutation of the logical matrix, and low-rank approximation is
    invariant under column permutations).
    """
    if grad.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        return None
    numel = grad.numel()
    if numel == 0:
        return None
    if grad.dim() == 0:
        return grad.storage_offset() - buffer.storage_offset()
    n = grad.shape[0]
    inner = numel // n
    if n > 1 and grad.stride(0) != inner:
        return None
    # Dense: the inner dims must exactly tile `inner` elements (any permutation of strides).
    dims = sorted(((grad.stride(d), grad.shape[d]) for d in range(1, grad.dim()) if grad.shape[d] != 1))
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return grad.storage_offset() - buffer.storage_offset()


class BucketLayout:
    """Where the compressed matrices and the uncompressed gradients of one bucket live (see module docstring).

    Build with :meth:`from_gradients` (layer-wise hook) or :meth:`batched` (whole bucket as one square matrix).
    ``table``/``tiles`` live on the bucket's device and are made once; :meth:`matches` tells whether a bucket still
    has the layout this object was built for (DDP rebuilds buckets after its first iteration).
    """

    def __init__(
        self,
        *,
        numel: int,
        device: torch.device,
        matrices: List[MatrixSpec],
        uncompressed: List[Tuple[int, int]],
        signature: tuple,
        numel_before: int,
        numel_after: int,
        batched: bool,
        rank: int,
    ):
        self.numel = numel
        self.device = torch.device(device)
        self.matrices = matrices
        self.num_matrices = len(matrices)  # an attribute, not a property: read several times per hook step
        self.uncompressed = _merge_segments(uncompressed)
        self.signature = signature
        self.numel_before_compression = numel_before
        self.numel_after_compression = numel_after
        self.batched = batched
        self.matrix_approximation_rank = rank
        self.p_numel = sum(s.n * s.rank for s in matrices)
        self.q_numel = sum(s.m * s.rank for s in matrices)
        # the batched view keeps error memory for its zero padding too (PyTorch's batched hook), <= 2s - 1 floats
        self.e_numel = sum(s.n * s.m if batched else s.numel for s in matrices)
        self.uncompressed_numel = sum(length for _, length in self.uncompressed)
        self.max_rank = max((s.rank for s in matrices), default=0)
        self.groups = _shape_groups(matrices)
        rows = [
            table_row(TABLE_WIDTH, {OFF: s.offset, ROWS: s.n, COLS: s.m, NUMEL: s.numel, RANK: s.rank,
                                     P_OFF: s.p_offset, Q_OFF: s.q_offset, E_OFF: s.e_offset})
            for s in matrices
        ]
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, TABLE_WIDTH).to(self.device)
        self._tiles: Dict[tuple, object] = {}
        self._uncompressed_index: Optional[torch.Tensor] = None
        self._workspace: Optional[torch.Tensor] = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_gradients(
        cls,
        buffer: torch.Tensor,
        gradients: Sequence[torch.Tensor],
        matrix_approximation_rank: int,
        min_compression_rate: float,
    ) -> "BucketLayout":
        """Layer-wise layout of a bucket (``powerSGD_hook``).

        Args:
            buffer: the bucket's flat 1-D buffer (``bucket.buffer()``), float32/float16/bfloat16.
            gradients: ``bucket.gradients()``, views into ``buffer``.
            matrix_approximation_rank: the rank r (>= 1).
            min_compression_rate: compress a matrix only if it saves at least this factor.
        Raises:
            ValueError: ``buffer`` is not 1-D or a gradient does not lie inside it.
        """
        if buffer.dim() != 1:
            raise ValueError(f"bucket buffer must be 1-D, got shape {tuple(buffer.shape)}")
        total = buffer.numel()
        candidates: List[Tuple[int, int, int, int, int]] = []  # grad_index, offset, n, m, rank
        uncompressed: List[Tuple[int, int]] = []
        before = after = 0
        sig = []
        for gi, g in enumerate(gradients):
            off = matrix_segment(g, buffer)
            if off is None and g.numel() > 0:
                raise ValueError(
                    f"gradient {gi} (shape {tuple(g.shape)}, strides {g.stride()}) is not a dense view into the "
                    "bucket buffer"
                )
            numel = g.numel()
            if numel == 0:
                sig.append((gi, -1, tuple(g.shape)))
                continue
            if off < 0 or off + numel > total:
                raise ValueError(f"gradient {gi} lies outside the bucket buffer")
            sig.append((gi, off, tuple(g.shape)))
            n = g.shape[0] if g.dim() > 0 else 1
            m = numel // n
            r = min(n, m, matrix_approximation_rank)
            compress, unc, comp = should_compress(n, m, r, min_compression_rate)
            before += unc
            if compress:
                after += comp
                candidates.append((gi, off, n, m, r))
            else:
                after += unc
                uncompressed.append((off, numel))
        # PyTorch's packing: group by (n, m) in order of first appearance.
        order: Dict[Tuple[int, int], List[Tuple[int, int, int, int, int]]] = {}
        for c in candidates:
            order.setdefault((c[2], c[3]), []).append(c)
        matrices = []
        p_off = q_off = e_off = 0
        for group in order.values():
            for gi, off, n, m, r in group:
                matrices.append(MatrixSpec(gi, off, n, m, n * m, r, p_off, q_off, e_off))
                p_off += n * r
                q_off += m * r
                e_off += n * m
        signature = ("layerwise", total, buffer.dtype, matrix_approximation_rank, min_compression_rate, tuple(sig))
        return cls(
            numel=total,
            device=buffer.device,
            matrices=matrices,
            uncompressed=uncompressed,
            signature=signature,
            numel_before=before,
            numel_after=after,
            batched=False,
            rank=matrix_approximation_rank,
        )

    @classmethod
    def batched(cls, numel: int, matrix_approximation_rank: int, device, dtype=torch.float32) -> "BucketLayout":
        """Batched layout (``batched_powerSGD_hook``): the flat buffer of ``numel`` elements as one ``s x s`` matrix.

        ``s = ceil(sqrt(numel))``; elements with flat index ``>= numel`` are the zero padding, masked in the kernels
        (never stored). Rank ``min(s, matrix_approximation_rank)``. Stats as PyTorch: before ``numel``, after
        ``2 * s * r``. Raises ``ValueError`` for an empty bucket.
        """
        if numel <= 0:
            raise ValueError("cannot build a batched layout for an empty bucket")
        s = math.isqrt(numel)
        if s * s < numel:
            s += 1
        r = min(s, matrix_approximation_rank)
        spec = MatrixSpec(-1, 0, s, s, numel, r, 0, 0, 0)
        signature = ("batched", numel, dtype, matrix_approximation_rank)
        return cls(
            numel=numel,
            device=device,
            matrices=[spec],
            uncompressed=[],
            signature=signature,
            numel_before=numel,
            numel_after=2 * s * r,
            batched=True,
            rank=matrix_approximation_rank,
        )

    # ---------------------------------------------------------------- queries
    def matches_gradients(self, buffer: torch.Tensor, gradients: Sequence[torch.Tensor], rank, min_rate) -> bool:
        """True when ``buffer``/``gradients`` have the offsets and shapes this layout was built for."""
        if self.batched:
            return False
        sig = []
        for gi, g in enumerate(gradients):
            if g.numel() == 0:
                sig.append((gi, -1, tuple(g.shape)))
                continue
            off = matrix_segment(g, buffer)
            if off is None:
                return False
            sig.append((gi, off, tuple(g.shape)))
        expected = ("layerwise", buffer.numel(), buffer.dtype, rank, min_rate, tuple(sig))
        return expected == self.signature

    def __getstate__(self) -> dict:
        """Pickled without what is derived from it (tile tables, launch plans holding compiled-kernel handles, the
        workspace): rebuilt on first use after unpickling, so a pickled layout never carries a kernel object."""
        state = dict(self.__dict__)
        state["_tiles"], state["_uncompressed_index"], state["_workspace"] = {}, None, None
        return state

    def memo(self, key: tuple, build: Callable[[], object]) -> object:
        """``build()``'s result, computed once per ``key`` and kept with the layout's tile tables (plans and tables
        derived from the layout by the kernels' launchers and the torch backend; ``None`` is kept like any value)."""
        if key not in self._tiles:
            self._tiles[key] = build()
        return self._tiles[key]

    def tiles(self, kind: str, block: int) -> torch.Tensor:
        """Device ``int32`` table of shape ``(T, 2)``: ``(matrix index, first row or column)`` of each tile
        (:data:`TILE_COLUMNS`).

        ``kind="rows"`` tiles every M_i into blocks of ``block`` rows (project, reconstruct); ``kind="cols"`` into
        blocks of ``block`` columns (project_t). Cached per (kind, block).
        """
        key = (kind, int(block))
        t = self._tiles.get(key)
        if t is None:
            if kind not in ("rows", "cols"):
                raise ValueError(f"unknown tile kind {kind!r}")
            mats, starts = [], []
            for i, s in enumerate(self.matrices):
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
            t = torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)
            self._tiles[key] = t
        return t

    def project_t_tiles(self, block: int, split_rows: int = 0, reduce_block: Optional[int] = None):
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
        cached = self._tiles.get(key)
        if cached is None:
            tiles, reduce_tiles = [], []
            ws = 0

            def tile(mat, col0, row0, row_end, ws_off):
                return table_row(PROJECT_T_TILE_WIDTH, {PROJECT_T_MAT: mat, PROJECT_T_COL0: col0,
                                                         PROJECT_T_ROW0: row0, PROJECT_T_ROW_END: row_end,
                                                         PROJECT_T_WS_OFF: ws_off})

            for i, s in enumerate(self.matrices):
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
                return torch.tensor(rows, dtype=torch.int32).reshape(-1, width).to(self.device)

            cached = (dev(tiles, PROJECT_T_TILE_WIDTH), dev(reduce_tiles, REDUCE_TILE_WIDTH) if reduce_tiles else None,
                      ws)
            self._tiles[key] = cached
        return cached

    def reconstruct_tiles(self, block: int, split_cols: int = 0) -> torch.Tensor:
        """Tile table of reconstruct: device ``int32 (T, 4)`` (:data:`RECON_TILE_COLUMNS`: matrix, first row, first
        column, end column), ``block`` rows per tile and at most ``split_cols`` columns per program (0: whole
        rows). Cached."""
        key = ("rows4", int(block), int(split_cols))
        t = self._tiles.get(key)
        if t is None:
            rows = []
            for i, s in enumerate(self.matrices):
                chunk = split_cols if 0 < split_cols < s.m else s.m
                for r0 in range(0, s.n, block):
                    for c in range(0, s.m, chunk):
                        rows.append(table_row(RECON_TILE_WIDTH, {RECON_MAT: i, RECON_ROW0: r0, RECON_COL0: c,
                                                                  RECON_COL_END: min(s.m, c + chunk)}))
            t = torch.tensor(rows, dtype=torch.int32).reshape(-1, RECON_TILE_WIDTH).to(self.device)
            self._tiles[key] = t
        return t

    def average_tiles(self, which: str, packed: bool, block: int):
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
        if packed is False and len(self.uncompressed) > 1:
            raise ValueError("uncompressed gradients in several ranges must be packed")
        key = ("average", which, bool(packed), int(block))
        cached = self._tiles.get(key)
        if cached is None:
            rows, first = [], [0]
            for i, s in enumerate(self.matrices):
                start = s.p_offset if which == "p" else s.q_offset
                count = (s.n if which == "p" else s.m) * s.rank
                for c in range(0, count, block):
                    rows.append(table_row(AVERAGE_TILE_WIDTH, {AVERAGE_MAT: i, AVERAGE_SRC: start + c,
                                                                AVERAGE_DST: start + c,
                                                                AVERAGE_COUNT: min(block, count - c)}))
                first.append(len(rows))
            pos = 0
            for off, n in self.uncompressed:
                for c in range(0, n, block):
                    src = (pos if packed else off) + c
                    rows.append(table_row(AVERAGE_TILE_WIDTH, {AVERAGE_MAT: -1, AVERAGE_SRC: src, AVERAGE_DST: off + c,
                                                                AVERAGE_COUNT: min(block, n - c)}))
                pos += n
            cached = (
                torch.tensor(rows, dtype=torch.int64).reshape(-1, AVERAGE_TILE_WIDTH).to(self.device),
                torch.tensor(first, dtype=torch.int32).to(self.device),
            )
            self._tiles[key] = cached
        return cached

    def workspace(self, numel: int) -> torch.Tensor:
        """A float32 scratch buffer of at least ``numel`` elements on the layout's device, kept for reuse."""
        ws = self._workspace
        if ws is None or ws.numel() < numel:
            ws = torch.empty(max(numel, 1), dtype=torch.float32, device=self.device)
            self._workspace = ws
        return ws

    def segment_tiles(self, block: int, to_packed: bool) -> torch.Tensor:
        """Device ``int64 (T, 3)`` table ``(source offset, destination offset, count)`` of the uncompressed segments
        in chunks of at most ``block`` elements: bucket -> packed buffer (``to_packed``) or back. Cached."""
        key = ("segments", int(block), bool(to_packed))
        t = self._tiles.get(key)
        if t is None:
            rows = []
            packed = 0
            for off, n in self.uncompressed:
                for c in range(0, n, block):
                    count = min(block, n - c)
                    rows.append((off + c, packed + c, count) if to_packed else (packed + c, off + c, count))
                packed += n
            t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(self.device)
            self._tiles[key] = t
        return t

    def uncompressed_index(self) -> Optional[torch.Tensor]:
        """Device ``int64`` index of every uncompressed element (None if the segments are one range or none)."""
        if len(self.uncompressed) <= 1:
            return None
        if self._uncompressed_index is None:
            idx = np.concatenate([np.arange(o, o + n, dtype=np.int64) for o, n in self.uncompressed])
            self._uncompressed_index = torch.from_numpy(idx).to(self.device)
        return self._uncompressed_index

    def factor_matrix_index(self, which: str) -> torch.Tensor:
        """Device ``int64`` tensor of ``p_numel`` (``which="p"``) or ``q_numel`` (``"q"``) elements: the index of the
        matrix each element of the flat P (Q) belongs to (for per-matrix reductions over a factor). Cached."""
        if which not in ("p", "q"):
            raise ValueError(f"which must be 'p' or 'q', got {which!r}")
        key = ("factor_matrix_index", which)
        t = self._tiles.get(key)
        if t is None:
            sizes = [(s.n if which == "p" else s.m) * s.rank for s in self.matrices]
            idx = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
            t = torch.from_numpy(idx).to(self.device)
            self._tiles[key] = t
        return t

    def gather_uncompressed(self, buffer: torch.Tensor) -> torch.Tensor:
        """The uncompressed gradients as one contiguous tensor (a view when they form one range, else a gather)."""
        if not self.uncompressed:
            return buffer.new_empty(0)
        if len(self.uncompressed) == 1:
            o, n = self.uncompressed[0]
            return buffer[o : o + n]
        return buffer.index_select(0, self.uncompressed_index())

    def scatter_uncompressed(self, buffer: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (from :meth:`gather_uncompressed`) back into ``buffer``; no-op if it was a view."""
        if len(self.uncompressed) <= 1:
            if self.uncompressed:
                o, n = self.uncompressed[0]
                dst = buffer[o : o + n]
                if dst.data_ptr() != values.data_ptr():
                    dst.copy_(values)
            return
        buffer.index_copy_(0, self.uncompressed_index(), values)

    def __repr__(self) -> str:
        kind = "batched" if self.batched else "layer-wise"
        return (
            f"BucketLayout({kind}, numel={self.numel}, compressed={self.num_matrices}, "
            f"uncompressed_numel={self.uncompressed_numel}, P={self.p_numel}, Q={self.q_numel})"
        )


def table_row(width: int, values: Dict[int, int]) -> List[int]:
    """One row of a kernel table from ``{column index: value}`` naming each of its ``width`` columns once."""
    if sorted(values) != list(range(width)):
        raise ValueError(f"a table row needs columns 0..{width - 1} each once, got {sorted(values)}")
    row = [0] * width
    for col, value in values.items():
        row[col] = value
    return row


def _merge_segments(segments: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    merged: List[Tuple[int, int]] = []
    for off, n in sorted(segments):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return merged


def _shape_groups(matrices: List[MatrixSpec]) -> List[ShapeGroup]:
    groups: List[ShapeGroup] = []
    for i, s in enumerate(matrices):
        g = groups[-1] if groups else None
        if g is not None and (g.n, g.m, g.rank) == (s.n, s.m, s.rank) and s.numel == s.n * s.m:
            groups[-1] = ShapeGroup(g.n, g.m, g.rank, g.first, g.count + 1)
        else:
            groups.append(ShapeGroup(s.n, s.m, s.rank, i, 1))
    return groups
