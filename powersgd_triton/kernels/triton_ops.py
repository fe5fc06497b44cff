"""Launchers for the Triton bucket kernels, their config spaces, heuristics and ahead-of-time compilation.

Each launcher issues exactly ONE kernel launch for the whole bucket (no torch ops besides cached table lookups), so a
PowerSGD step costs a constant number of launches whatever the number of matrices L. Shapes and dtypes are those of
:mod:`powersgd_triton.ops`, which validates its inputs before calling here.

A config is a dict of the kernel's block sizes plus ``num_warps``/``num_stages``:

=================  ===================================================
kernel             keys
=================  ===================================================
``project``        ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``USE_DOT``
``project_t``      ``BLOCK_M`` columns per tile, ``BLOCK_K`` rows per step, ``SPLIT_ROWS`` rows per
                   program at most (0: no split), ``USE_DOT``
``orthogonalize``  ``BLOCK`` rows per tile, ``SHORT_ROWS`` most rows of a factor done by one program (taller
                   ones are split: two launches), ``GRAM_ROWS`` rows per float64 Gram slot of a split
                   factor (with ``BLOCK`` it fixes the summation order), ``SPLIT_ROWS`` rows per program
                   of the apply pass of a split factor
``reconstruct``    ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``USE_DOT``
=================  ===================================================

:func:`config_space` lists the candidates the autotuner times, :func:`heuristic_config` the untuned default, and
:data:`INTERPRETER_CONFIGS` the one config used under ``TRITON_INTERPRET=1`` (large blocks: the interpreter's cost
grows with programs × loop steps). :func:`compile_aot` compiles a kernel for a GPU target on a machine without GPU.
"""

import itertools
import weakref
from typing import Dict, Iterable, List, Optional

import torch
import triton

from .. import _env
from ..layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank  # noqa: F401 - re-exported
from .lowrank_mm import _project_kernel, _project_t_kernel, _reduce_splits_kernel
from .orthogonalize import _commit_factor_kernel, _ortho_gram_kernel, _orthogonalize_kernel
from .reconstruct import _reconstruct_kernel
from .segments import _copy_segments_kernel

KERNEL_FUNCTIONS = {
    "project": _project_kernel,
    "orthogonalize": _orthogonalize_kernel,
    "orthogonalize_gram": _ortho_gram_kernel,  # first launch of orthogonalize when a factor is split over rows
    "project_t": _project_t_kernel,
    "reconstruct": _reconstruct_kernel,
    "reduce_splits": _reduce_splits_kernel,  # second stage of project_t for split (tall) matrices
    "copy_segments": _copy_segments_kernel,  # pack / unpack of the uncompressed gradients
    "commit_factor": _commit_factor_kernel,  # warm-start factor update where finite and non-zero
}
SEGMENT_BLOCK = 1024
# Register budget for the broadcast-multiply path: elements of the [BLOCK, BLOCK_K, R] product per program.
MAX_BROADCAST_ELEMENTS = 16384
# Orthogonalize: a factor of at most SHORT_ROWS rows is done by one program (one launch for the bucket); the heuristic
# allows ORTHO_SHORT_BYTES of float32 factor per program (two passes over it by one SM, the second from L2: a few
# microseconds, about an extra launch), and splits taller factors (GPT-2's and BERT's embeddings) over rows.
ORTHO_SHORT_BYTES = 128 * 1024
# Rows per program of the apply pass of a split factor: >= 2 programs per SM of an H100/H200 (132 SMs) for BERT's
# 30522-row and GPT-2's 50257-row embeddings (318 and 524 programs).
ORTHO_SPLIT_ROWS = 96
# Largest [BLOCK, R] tile of an orthogonalize candidate (held in float64 in registers: 64 per thread at 8 warps).
ORTHO_MAX_TILE = 8192
# project_t splits matrices taller than this over several programs (GPT-2's 50257-row embedding would otherwise
# get only m / BLOCK_M programs).
DEFAULT_SPLIT_ROWS = 2048

INTERPRETER_CONFIGS: Dict[str, dict] = {
    "project": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "project_t": dict(BLOCK_M=64, BLOCK_K=64, SPLIT_ROWS=0, USE_DOT=False, num_warps=4, num_stages=1),
    "orthogonalize": dict(BLOCK=256, SHORT_ROWS=4096, GRAM_ROWS=256, SPLIT_ROWS=256, num_warps=4, num_stages=1),
    "reconstruct": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
}


def _tile_key(kernel: str) -> str:
    return "BLOCK_M" if kernel == "project_t" else "BLOCK_N"


# Candidate (tile, BLOCK_K) pairs; filtered per rank by the register budget of the broadcast path.
_BROADCAST_TILES = {
    "project": [(16, 128), (32, 32), (32, 64), (32, 128), (64, 32), (64, 64), (128, 32)],
    "reconstruct": [(16, 128), (32, 32), (32, 64), (32, 128), (64, 32), (64, 64), (128, 32)],
    "project_t": [(32, 64), (64, 16), (64, 32), (64, 64), (128, 16), (128, 32)],
}
_DOT_TILES = [(64, 32), (64, 64), (128, 32)]


def config_space(kernel: str, max_rank: int, dtype: torch.dtype) -> List[dict]:
    """Candidate configs the autotuner times for ``kernel`` at this rank and gradient dtype.

    Broadcast-multiply tiles are kept while ``tile * BLOCK_K * R <= MAX_BROADCAST_ELEMENTS`` (registers);
    ``tl.dot`` tiles are offered from rank 8 on (below that, padding r to 16 only multiplies the FMAs).
    Orthogonalize: the heuristics of every rank at 8 and 4 warps whose float64 tile fits (:func:`_ortho_configs`).
    Raises ``ValueError`` for an unknown kernel name.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "orthogonalize":
        return _ortho_configs(padded_rank(max_rank))
    tile = _tile_key(kernel)
    out = []
    r = padded_rank(max_rank)
    for bt, bk in _BROADCAST_TILES[kernel]:
        if bt * bk * r > MAX_BROADCAST_ELEMENTS:
            continue
        for warps in (4, 8):
            out.append({tile: bt, "BLOCK_K": bk, "USE_DOT": False, "num_warps": warps, "num_stages": 1})
    if max_rank >= 8:
        for (bt, bk), stages in itertools.product(_DOT_TILES, (1, 2)):
            out.append({tile: bt, "BLOCK_K": bk, "USE_DOT": True, "num_warps": 4, "num_stages": stages})
    if not out:  # very large rank: smallest broadcast tile
        out.append({tile: 16, "BLOCK_K": 16, "USE_DOT": False, "num_warps": 4, "num_stages": 1})
    if kernel == "project_t":
        for c in out:
            c["SPLIT_ROWS"] = DEFAULT_SPLIT_ROWS
    return out


def heuristic_config(kernel: str, layout: Optional[BucketLayout], dtype: torch.dtype) -> dict:
    """Untuned default for ``kernel``: the interpreter config under TRITON_INTERPRET=1, else a GPU heuristic.

    GPU heuristic: memory-bound streaming with about 8K fp32 products per program in registers for r <= 8, tensor
    cores (``tl.dot``) from r >= 16 on.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if _env.interpreter_enabled():
        return dict(INTERPRETER_CONFIGS[kernel])
    max_rank = layout.max_rank if layout is not None else 4
    if kernel == "orthogonalize":
        return _ortho_heuristic(padded_rank(max_rank))
    r = padded_rank(max_rank)
    wide_k = 128 if dtype in (torch.float16, torch.bfloat16) else 64
    split = {"SPLIT_ROWS": DEFAULT_SPLIT_ROWS} if kernel == "project_t" else {}
    if r >= MIN_DOT_RANK:
        return {_tile_key(kernel): 64, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4, "num_stages": 2, **split}
    bk = max(16, min(wide_k, 8192 // (32 * r)))
    if kernel == "project_t":
        bk = max(16, min(64, 8192 // (64 * r)))
        return dict(BLOCK_M=64, BLOCK_K=bk, USE_DOT=False, num_warps=4, num_stages=1, **split)
    return {"BLOCK_N": 32, "BLOCK_K": bk, "USE_DOT": False, "num_warps": 4, "num_stages": 1}


def _resolve(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict]) -> dict:
    if config is None:
        return heuristic_config(kernel, layout, dtype)
    return config


def _launch_options(cfg: dict) -> dict:
    return {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 1)}


def project(buffer, layout: BucketLayout, q, p, error=None, *, config: Optional[dict] = None) -> None:
    """One launch: ``P_i = (M_i [+ E_i]) · Q_i`` for all i (see :func:`powersgd_triton.ops.project`)."""
    cfg = _resolve("project", layout, buffer.dtype, config)
    tiles = layout.tiles("rows", cfg["BLOCK_N"])
    R = padded_rank(layout.max_rank, cfg["USE_DOT"])
    _project_kernel[(tiles.shape[0],)](
        buffer, q, p, error if error is not None else p, layout.table, tiles,
        HAS_ERROR=error is not None, R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"],
        **_launch_options(cfg),
    )


def project_t(buffer, layout: BucketLayout, p, q, *, config: Optional[dict] = None) -> None:
    """``Q_i = M_iᵀ · P_i`` for all i (see :func:`powersgd_triton.ops.project_t`): one launch, plus one for the
    fixed-order reduction when a matrix taller than ``SPLIT_ROWS`` is split over rows."""
    cfg = _resolve("project_t", layout, buffer.dtype, config)
    split = int(cfg.get("SPLIT_ROWS", 0))
    tiles, reduce_tiles, ws_numel = layout.column_tiles(cfg["BLOCK_M"], split)
    R = padded_rank(layout.max_rank, cfg["USE_DOT"])
    ws = layout.workspace(ws_numel) if reduce_tiles is not None else p
    _project_t_kernel[(tiles.shape[0],)](
        buffer, p, q, ws, layout.table, tiles,
        R=R, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], SPLIT_ROWS=split if reduce_tiles is not None else 0,
        USE_DOT=cfg["USE_DOT"], **_launch_options(cfg),
    )
    if reduce_tiles is not None:
        _reduce_splits_kernel[(reduce_tiles.shape[0],)](
            ws, q, layout.table, reduce_tiles, R=R, BLOCK_M=cfg["BLOCK_M"], num_warps=4, num_stages=1
        )


def _ortho_heuristic(R: int) -> dict:
    """Orthogonalize default at padded rank R, from a model of an H100/H200 (132 SMs, ~4 TB/s, 64K registers/SM).

    * ``BLOCK`` rows per tile: 1-4 KiB of float32 factor per load (256 rows up to R 4, 1024 / R above), held in
      float64 in registers; 8 warps. Chosen from the sm_90 compile (ptxas -v, triton 3.9): no spills at any R <= 32,
      at most 128 registers per thread up to R 16 (a BLOCK of 512 spills 8 bytes at R 1, takes 166 registers at R 2);
    * ``SHORT_ROWS``: ``ORTHO_SHORT_BYTES`` of factor per program, at most 32 tiles (8192 rows up to R 4:
      ResNet-50's, BERT's and GPT-2's layers other than the embeddings are one launch; 2048 at R 16);
    * ``GRAM_ROWS``: rows per float64 Gram slot, 512 up to R 4, 1024 up to R 16, 2048 at R 32. Every program of the
      apply pass sums all slots of its matrix, ``slots·R²·8`` bytes from L2 (GPT-2's 50257 rows: 99 slots, 13 KiB at
      R 4; 50 slots, 100 KiB at R 16), and the Gram launch has one program per slot (8-64 KiB of factor each);
    * ``SPLIT_ROWS``: ``ORTHO_SPLIT_ROWS`` up to R 8 (>= 2 programs per SM for the embeddings), twice that
      above (the slots every program sums grow as R²: half the programs, half the L2 traffic); 3 stages (the row
      loops are software-pipelined, several tiles in flight per SM).
    """
    block = 256 if R <= 4 else max(16, 1024 // R)
    short = max(block, min(ORTHO_SHORT_BYTES // (4 * R), 32 * block))
    gram = max(block, 512 if R <= 4 else 1024 if R <= 16 else 2048)
    split = ORTHO_SPLIT_ROWS if R <= 8 else 2 * ORTHO_SPLIT_ROWS
    return dict(BLOCK=block, SHORT_ROWS=short, GRAM_ROWS=gram, SPLIT_ROWS=split, num_warps=8, num_stages=3)


def _ortho_configs(R: int) -> List[dict]:
    """Orthogonalize candidates at padded rank R: the heuristic of every rank 1..32, at 8 and 4 warps, whose float64
    tile fits (``BLOCK * R <= ORTHO_MAX_TILE``); the rank's own heuristic first. Every rank's candidates are a subset
    of rank 4's (all of them), so compiling rank 4's covers them all."""
    own = _ortho_heuristic(R)
    out = [own]
    for r in (1, 2, 4, 8, 16, 32):
        h = _ortho_heuristic(r)
        for c in (h, dict(h, num_warps=4)):
            if c["BLOCK"] * R <= ORTHO_MAX_TILE and c not in out:
                out.append(c)
    return out


def _check_ortho_config(cfg: dict) -> None:
    """Raise ``ValueError`` unless BLOCK is a power of two >= 16, SHORT_ROWS and GRAM_ROWS multiples of it and
    SPLIT_ROWS a positive multiple of 16 (a split program writes ceil(SPLIT_ROWS / BLOCK) tiles, masked)."""
    block = cfg.get("BLOCK")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"orthogonalize config: BLOCK must be a power of two >= 16, got {block!r}")
    for key in ("SHORT_ROWS", "GRAM_ROWS"):
        v = cfg.get(key)
        if not isinstance(v, int) or v < block or v % block:
            raise ValueError(f"orthogonalize config: {key} must be a multiple of BLOCK ({block}), got {v!r}")
    split = cfg.get("SPLIT_ROWS")
    if not isinstance(split, int) or split < 16 or split % 16:
        raise ValueError(f"orthogonalize config: SPLIT_ROWS must be a positive multiple of 16, got {split!r}")


# Per layout (weakly held): {(which, R, BLOCK, SHORT_ROWS, GRAM_ROWS, SPLIT_ROWS): _OrthoPlan}
_ORTHO_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ortho_slot_block(R: int) -> int:
    """Gram slots summed per step by a program of a split factor: 16 KiB of float64 per load (2 to 64 slots)."""
    return max(2, min(64, 2048 // (R * R)))


def _ortho_constexprs(cfg: dict, R: int) -> dict:
    """The orthogonalize kernels' loop constexprs, functions of the config and the padded rank R: ``GROUP_TILES``
    (tiles per Gram slot, first launch), ``CHUNK_TILES`` (tiles per unconditional inner loop), ``SHORT_CHUNKS``,
    ``APPLY_CHUNKS`` and ``SLOT_BLOCK``."""
    _check_ortho_config(cfg)
    block = cfg["BLOCK"]
    chunk_tiles = min(4, cfg["SHORT_ROWS"] // block)
    chunk = chunk_tiles * block
    return dict(
        BLOCK=block,
        GROUP_TILES=cfg["GRAM_ROWS"] // block,
        CHUNK_TILES=chunk_tiles,
        SHORT_CHUNKS=-(-cfg["SHORT_ROWS"] // chunk),
        APPLY_CHUNKS=-(-max(cfg["SHORT_ROWS"], cfg["SPLIT_ROWS"]) // chunk),
        SLOT_BLOCK=_ortho_slot_block(R),
    )


class _OrthoPlan:
    """Host-side launch plan of one orthogonalize call (see :func:`orthogonalize_plan`); device tables made lazily."""

    def __init__(self, layout: BucketLayout, which: str, cfg: dict):
        self.R = padded_rank(layout.max_rank)
        self.consts = _ortho_constexprs(cfg, self.R)
        short, gram_rows, split = cfg["SHORT_ROWS"], cfg["GRAM_ROWS"], cfg["SPLIT_ROWS"]
        chunk = self.consts["CHUNK_TILES"] * cfg["BLOCK"]
        self.gram_tasks: List[tuple] = []  # (matrix, first row, slot, head slot, rm)
        self.tasks: List[tuple] = []  # (matrix, first row, end row, first slot, slots, head slot, rm)
        self.tiles: List[int] = []  # per finish task: tiles of BLOCK rows read and written (chunks rounded up)
        self.slot_steps: List[int] = []  # per finish task: steps of the slot sum
        slot = 0
        self.split_matrices = 0
        self.factor_elems = 0  # valid elements of the factors
        self.split_elems = 0
        for i, s in enumerate(layout.matrices):
            rows = s.n if which == "p" else s.m
            rm = padded_rank(s.rank)  # completion vectors of this factor (the torch backend's too)
            self.factor_elems += rows * s.rank
            if rows <= short:
                self.tasks.append((i, 0, rows, 0, 0, -1, rm))
                self.tiles.append(2 * -(-rows // chunk) * self.consts["CHUNK_TILES"])
                self.slot_steps.append(0)
                continue
            parts = -(-rows // gram_rows)
            head = slot + parts
            for k in range(parts):
                self.gram_tasks.append((i, k * gram_rows, slot + k, head if k == 0 else -1, rm))
            for c in range(0, rows, split):
                self.tasks.append((i, c, min(c + split, rows), slot, parts, head, rm))
                self.tiles.append(-(-(min(c + split, rows) - c) // chunk) * self.consts["CHUNK_TILES"])
                self.slot_steps.append(-(-parts // self.consts["SLOT_BLOCK"]))
            slot += parts + 1
            self.split_matrices += 1
            self.split_elems += rows * s.rank
        self.slots = slot
        self._device_tables = None

    def device_tables(self, device):
        if self._device_tables is None:
            def dev(rows, width):
                return torch.tensor(rows, dtype=torch.int64).reshape(-1, width).to(device)

            self._device_tables = (dev(self.gram_tasks, 5) if self.gram_tasks else None, dev(self.tasks, 7))
        return self._device_tables


def _ortho_plan(layout: BucketLayout, which: str, cfg: dict) -> _OrthoPlan:
    key = (which, padded_rank(layout.max_rank), cfg.get("BLOCK"), cfg.get("SHORT_ROWS"), cfg.get("GRAM_ROWS"),
           cfg.get("SPLIT_ROWS"))
    plans = _ORTHO_PLANS.setdefault(layout, {})
    plan = plans.get(key)
    if plan is None:
        plan = _OrthoPlan(layout, which, cfg)
        plans[key] = plan
    return plan


def _ortho_workspace(layout: BucketLayout, slots: int, R: int) -> torch.Tensor:
    """float64 workspace of at least ``slots`` [R, R] Gram slots, kept per layout for reuse."""
    plans = _ORTHO_PLANS.setdefault(layout, {})
    ws = plans.get("workspace")
    need = max(1, slots * R * R)
    if ws is None or ws.numel() < need:
        ws = torch.empty(need, dtype=torch.float64, device=layout.device)
        plans["workspace"] = ws
    return ws


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float, out, *, config: Optional[dict] = None) -> None:
    """Orthogonalize every P_i (``which="p"``) or Q_i (``"q"``): ONE launch when every factor has at most
    ``SHORT_ROWS`` rows, else two (float64 Gram slots of the split factors, then the rest); see
    :mod:`powersgd_triton.kernels.orthogonalize`. Raises ``ValueError`` for a malformed config."""
    cfg = _resolve("orthogonalize", layout, x.dtype, config)
    plan = _ortho_plan(layout, which, cfg)
    rows_col, off_col = (1, 5) if which == "p" else (2, 6)
    gram_tasks, tasks = plan.device_tables(x.device)
    ws = _ortho_workspace(layout, plan.slots, plan.R)  # float64 even when unused: one compiled signature
    c = plan.consts
    common = dict(ROWS_COL=rows_col, OFF_COL=off_col, R=plan.R, BLOCK=c["BLOCK"])
    if gram_tasks is not None:
        _ortho_gram_kernel[(gram_tasks.shape[0],)](
            x, ws, layout.table, gram_tasks, GROUP_TILES=c["GROUP_TILES"], **common, **_launch_options(cfg)
        )
    _orthogonalize_kernel[(tasks.shape[0],)](
        x, out, ws, layout.table, tasks, float(epsilon), CHUNK_TILES=c["CHUNK_TILES"], SHORT_CHUNKS=c["SHORT_CHUNKS"],
        APPLY_CHUNKS=c["APPLY_CHUNKS"], SLOT_BLOCK=c["SLOT_BLOCK"], **common, **_launch_options(cfg),
    )


def orthogonalize_plan(layout: BucketLayout, which: str, config: Optional[dict] = None) -> List[dict]:
    """The launches of one :func:`orthogonalize` call on ``layout`` (``which`` = "p" or "q"), in launch order.

    One dict per launch: ``kernel`` (a :data:`KERNEL_FUNCTIONS` name), ``programs`` (grid size), ``iterations``
    (the most loop trips of one program: tiles of ``BLOCK`` rows, reading and writing, plus steps of
    ``SLOT_BLOCK`` Gram slots), ``rank_steps`` (serial Gram-Schmidt steps on the r x r Gram per program, 0 for
    the Gram launch), ``split_programs`` (finish launch: programs of split factors),
    ``bytes_read`` / ``bytes_written`` (bytes the loads and stores of the whole launch touch: factor float32,
    Gram slots float64, task tables; a short factor is read twice, the second time likely from L2),
    ``config`` and ``variant`` (``compile_aot(kernel, config, ..., variant=variant)`` compiles exactly this
    launch). ``config=None``: the heuristic (or interpreter) config. Raises ``ValueError`` for an unknown
    ``which`` or a malformed config.
    """
    if which not in ("p", "q"):
        raise ValueError(f"which must be 'p' or 'q', got {which!r}")
    cfg = dict(_resolve("orthogonalize", layout, torch.float32, config))
    if layout.num_matrices == 0:
        return []
    plan = _ortho_plan(layout, which, cfg)
    R = plan.R
    variant = dict(ROWS_COL=1, OFF_COL=5) if which == "p" else dict(ROWS_COL=2, OFF_COL=6)
    table_bytes = 8 * 8  # one layout-table row per program
    slot_bytes = R * R * 8
    out = []
    if plan.gram_tasks:
        heads = sum(1 for t in plan.gram_tasks if t[3] >= 0)
        out.append(dict(
            kernel="orthogonalize_gram", programs=len(plan.gram_tasks), iterations=plan.consts["GROUP_TILES"],
            rank_steps=0,
            bytes_read=4 * plan.split_elems + len(plan.gram_tasks) * (table_bytes + 40) + heads * 4 * R * R,
            bytes_written=(len(plan.gram_tasks) + heads) * slot_bytes,
            config=dict(cfg), variant=dict(variant),
        ))
    short_elems = plan.factor_elems - plan.split_elems
    out.append(dict(
        kernel="orthogonalize", programs=len(plan.tasks),
        iterations=max(t + k for t, k in zip(plan.tiles, plan.slot_steps)), rank_steps=R,
        bytes_read=8 * short_elems + 4 * plan.split_elems + len(plan.tasks) * (table_bytes + 56)
        + sum(t[4] * slot_bytes for t in plan.tasks if t[4] > 0),
        bytes_written=4 * plan.factor_elems,
        config=dict(cfg), variant=dict(variant, WITH_GRAM=False),
        split_programs=len(plan.tasks) - (layout.num_matrices - plan.split_matrices),
    ))
    return out


def reconstruct(
    buffer,
    layout: BucketLayout,
    p,
    q,
    scale: float,
    error=None,
    update_error=None,
    *,
    local_p=None,
    local_q=None,
    config: Optional[dict] = None,
) -> None:
    """One launch: ``M_i ← P_i·(scale·Q_i)ᵀ`` and optionally ``E_i ← M_i − P_i·(scale·Q_i)ᵀ`` for all i.

    With ``local_p`` (``local_q``) the error is the local residual ``M_i − P_local·Q_iᵀ`` (``M_i − P_i·Q_localᵀ``).
    """
    cfg = _resolve("reconstruct", layout, buffer.dtype, config)
    tiles = layout.tiles("rows", cfg["BLOCK_N"])
    R = padded_rank(layout.max_rank, cfg["USE_DOT"])
    flag = p
    if update_error is not None:
        flag = update_error.reshape(1)
        if flag.dtype == torch.bool:
            flag = flag.view(torch.uint8)
    local_err = 1 if local_p is not None else 2 if local_q is not None else 0
    local = local_p if local_p is not None else local_q if local_q is not None else p
    _reconstruct_kernel[(tiles.shape[0],)](
        buffer, p, q, local, error if error is not None else p, flag, layout.table, tiles, float(scale),
        HAS_ERROR=error is not None, HAS_FLAG=update_error is not None, LOCAL_ERR=local_err,
        R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"],
        **_launch_options(cfg),
    )


def copy_segments(src, dst, layout: BucketLayout, to_packed: bool, scale: float = 1.0) -> None:
    """One launch: the uncompressed gradients, bucket -> packed buffer (``to_packed``) or packed -> bucket."""
    tiles = layout.segment_tiles(SEGMENT_BLOCK, to_packed)
    if tiles.shape[0] == 0:
        return
    _copy_segments_kernel[(tiles.shape[0],)](src, dst, tiles, float(scale), BLOCK=SEGMENT_BLOCK, num_warps=4)


def commit_factor(new, kept, layout: BucketLayout, which: str, ok) -> None:
    """One launch: ``kept_i <- new_i`` for every matrix whose new factor is not all zero, if ``ok`` (device flag)."""
    rows_col, off_col = (1, 5) if which == "p" else (2, 6)
    flag = ok.reshape(1)
    if flag.dtype == torch.bool:
        flag = flag.view(torch.uint8)
    _commit_factor_kernel[(layout.num_matrices,)](
        new, kept, flag, layout.table, ROWS_COL=rows_col, OFF_COL=off_col, BLOCK=256, num_warps=4
    )


# ----------------------------------------------------------------------------------------------- AOT compilation
_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _signature(kernel: str, grad_dtype: torch.dtype) -> Dict[str, str]:
    g = "*" + _TRITON_DTYPES[grad_dtype]
    f, i64, i32 = "*fp32", "*i64", "*i32"
    if kernel == "project":
        return dict(buf_ptr=g, q_ptr=f, p_ptr=f, e_ptr=f, table_ptr=i64, tiles_ptr=i32)
    if kernel == "project_t":
        return dict(buf_ptr=g, p_ptr=f, q_ptr=f, ws_ptr=f, table_ptr=i64, tiles_ptr=i32)
    if kernel == "reduce_splits":
        return dict(ws_ptr=f, q_ptr=f, table_ptr=i64, tiles_ptr=i32)
    if kernel == "copy_segments":
        return dict(src_ptr=g, dst_ptr=f, tiles_ptr=i64, scale="fp32")
    if kernel == "commit_factor":
        return dict(new_ptr=f, kept_ptr=f, flag_ptr="*u8", table_ptr=i64)
    if kernel == "orthogonalize":
        return dict(x_ptr=f, out_ptr=f, ws_ptr="*fp64", table_ptr=i64, tasks_ptr=i64, eps="fp32")
    if kernel == "orthogonalize_gram":
        return dict(x_ptr=f, ws_ptr="*fp64", table_ptr=i64, tasks_ptr=i64)
    return dict(
        buf_ptr=g, p_ptr=f, q_ptr=f, lf_ptr=f, e_ptr=f, flag_ptr="*u8", table_ptr=i64, tiles_ptr=i32, scale="fp32"
    )


def _constexprs(kernel: str, config: dict, max_rank: int, variant: dict) -> dict:
    use_dot = config.get("USE_DOT", False)
    c = {"R": padded_rank(max_rank, use_dot)}
    if kernel in ("orthogonalize", "orthogonalize_gram"):
        oc = _ortho_constexprs(config, c["R"])
        keys = ("BLOCK", "GROUP_TILES") if kernel == "orthogonalize_gram" else (
            "BLOCK", "CHUNK_TILES", "SHORT_CHUNKS", "APPLY_CHUNKS", "SLOT_BLOCK")
        c.update({k: oc[k] for k in keys})
        c.update(ROWS_COL=variant.get("ROWS_COL", 1), OFF_COL=variant.get("OFF_COL", 5))
        return c
    if kernel == "reduce_splits":
        c.update(BLOCK_M=config["BLOCK_M"], R=padded_rank(max_rank, use_dot))
        return c
    if kernel == "copy_segments":
        return {"BLOCK": SEGMENT_BLOCK}
    if kernel == "commit_factor":
        return {"BLOCK": 256, "ROWS_COL": variant.get("ROWS_COL", 2), "OFF_COL": variant.get("OFF_COL", 6)}
    c.update({k: config[k] for k in (_tile_key(kernel), "BLOCK_K", "USE_DOT")})
    if kernel == "project_t":
        c["SPLIT_ROWS"] = variant.get("SPLIT_ROWS", config.get("SPLIT_ROWS", 0))
    if kernel in ("project", "reconstruct"):
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
    if kernel == "reconstruct":
        c["HAS_FLAG"] = variant.get("HAS_FLAG", True)
        c["LOCAL_ERR"] = variant.get("LOCAL_ERR", 0)
    return c


def compile_aot(kernel: str, config: dict, grad_dtype: torch.dtype, max_rank: int, arch: int, variant=None):
    """Compile ``kernel`` with ``config`` for ``sm_<arch>`` (e.g. 80, 90) without a GPU; returns the compiled kernel.

    ``variant`` sets the feature constexprs (``HAS_ERROR``, ``HAS_FLAG``, ``ROWS_COL``/``OFF_COL``); ``orthogonalize``
    also compiles ``orthogonalize_gram`` (its first launch for split factors) unless ``WITH_GRAM=False``. Must run with
    ``TRITON_INTERPRET`` unset (the interpreter replaces ``@triton.jit`` functions at import time). Raises
    ``RuntimeError`` under the interpreter and whatever Triton raises on a compile error.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = KERNEL_FUNCTIONS[kernel]
    if not hasattr(fn, "arg_names") or _env.interpreter_enabled():
        raise RuntimeError("compile_aot needs TRITON_INTERPRET unset (kernels are interpreted functions here)")
    constexprs = _constexprs(kernel, config, max_rank, variant or {})
    signature = dict(_signature(kernel, grad_dtype))
    if kernel == "copy_segments" and not (variant or {}).get("to_packed", True):
        signature["src_ptr"], signature["dst_ptr"] = signature["dst_ptr"], signature["src_ptr"]
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": config.get("num_warps", 4), "num_stages": config.get("num_stages", 1)}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    if kernel == "project_t" and constexprs["SPLIT_ROWS"] > 0:  # the split path launches the reducer too
        compile_aot("reduce_splits", config, grad_dtype, max_rank, arch)
    if kernel == "orthogonalize" and (variant or {}).get("WITH_GRAM", True):  # and the Gram launch of split factors
        compile_aot("orthogonalize_gram", config, grad_dtype, max_rank, arch, variant)
    return compiled


def variants(kernel: str) -> Iterable[dict]:
    """The feature-flag combinations a kernel is launched with (all are compiled in the AOT test)."""
    if kernel == "project":
        return [dict(HAS_ERROR=True), dict(HAS_ERROR=False)]
    if kernel == "reconstruct":
        return [
            dict(HAS_ERROR=True, HAS_FLAG=True),
            dict(HAS_ERROR=True, HAS_FLAG=False),
            dict(HAS_ERROR=False, HAS_FLAG=False),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=1),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=2),
        ]
    if kernel in ("orthogonalize", "orthogonalize_gram"):
        return [dict(ROWS_COL=1, OFF_COL=5), dict(ROWS_COL=2, OFF_COL=6)]
    if kernel == "project_t":
        return [dict(SPLIT_ROWS=0), dict(SPLIT_ROWS=DEFAULT_SPLIT_ROWS)]
    if kernel == "copy_segments":
        return [dict(to_packed=True), dict(to_packed=False)]
    if kernel == "commit_factor":
        return [dict(ROWS_COL=1, OFF_COL=5), dict(ROWS_COL=2, OFF_COL=6)]
    return [dict()]
