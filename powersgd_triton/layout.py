"""Bucket layouts: which gradients of a DDP bucket are compressed, where they live, and the layout table.

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
matrix), built once. The per-launch tile and task tables derived from a layout are kernel plans, built by
:mod:`powersgd_triton.ops.tables` and kept with the layout in its :meth:`~BucketLayout.memo` store (this module
imports nothing of :mod:`powersgd_triton.ops`). The batched view (the batched hook) is a layout with a
single virtual ``s x s`` matrix, ``s = ceil(sqrt(N))``, whose elements past ``N`` are masked (``NUMEL`` column), so
the bucket is never resized. As in PyTorch's batched hook, the error memory covers the whole padded matrix (``s * s``
floats, at most ``2s - 1`` more than the bucket): the padding's ``M + E`` is its error memory.
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
        """Batched layout (the batched hook, PyTorch's batched semantics): the flat buffer of ``numel`` elements as
        one ``s x s`` matrix.

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

    def workspace(self, numel: int) -> torch.Tensor:
        """A float32 scratch buffer of at least ``numel`` elements on the layout's device, kept for reuse."""
        ws = self._workspace
        if ws is None or ws.numel() < numel:
            ws = torch.empty(max(numel, 1), dtype=torch.float32, device=self.device)
            self._workspace = ws
        return ws

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
