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
``orthogonalize``  ``BLOCK`` rows per step
``reconstruct``    ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``USE_DOT``
=================  ===================================================

:func:`config_space` lists the candidates the autotuner times, :func:`heuristic_config` the untuned default, and
:data:`INTERPRETER_CONFIGS` the one config used under ``TRITON_INTERPRET=1`` (large blocks: the interpreter's cost
grows with programs × loop steps). :func:`compile_aot` compiles a kernel for a GPU target on a machine without GPU.
"""

import itertools
from typing import Dict, Iterable, List, Optional

import torch
import triton

from .. import _env
from ..layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank  # noqa: F401 - re-exported
from .lowrank_mm import _project_kernel, _project_t_kernel, _reduce_splits_kernel
from .orthogonalize import _commit_factor_kernel, _orthogonalize_kernel
from .reconstruct import _reconstruct_kernel
from .segments import _copy_segments_kernel

KERNEL_FUNCTIONS = {
    "project": _project_kernel,
    "orthogonalize": _orthogonalize_kernel,
    "project_t": _project_t_kernel,
    "reconstruct": _reconstruct_kernel,
    "reduce_splits": _reduce_splits_kernel,  # second stage of project_t for split (tall) matrices
    "copy_segments": _copy_segments_kernel,  # pack / unpack of the uncompressed gradients
    "commit_factor": _commit_factor_kernel,  # warm-start factor update where finite and non-zero
}
SEGMENT_BLOCK = 1024
# Register budget for the broadcast-multiply path: elements of the [BLOCK, BLOCK_K, R] product per program.
MAX_BROADCAST_ELEMENTS = 16384
# Orthogonalize keeps a [BLOCK, R] fp32 tile per program and unrolls R columns: at most 16 tile elements per thread
# (BLOCK * R <= 512 * num_warps). Larger tiles take minutes to compile at R >= 16 (measured, CPU, sm_90, triton 3.9:
# BLOCK 512 / 4 warps / R 16: 220 s; BLOCK 512 / 8 warps / R 32: 450 s), which live tuning would pay per config, and
# are likely to spill registers (not measured yet: no GPU run).
MAX_ORTHO_TILE_PER_WARP = 512
# project_t splits matrices taller than this over several programs (GPT-2's 50257-row embedding would otherwise
# get only m / BLOCK_M programs).
DEFAULT_SPLIT_ROWS = 2048

INTERPRETER_CONFIGS: Dict[str, dict] = {
    "project": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "project_t": dict(BLOCK_M=64, BLOCK_K=64, SPLIT_ROWS=0, USE_DOT=False, num_warps=4, num_stages=1),
    "orthogonalize": dict(BLOCK=128, num_warps=4, num_stages=1),
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
    Orthogonalize tiles are kept while ``BLOCK * R <= MAX_ORTHO_TILE_PER_WARP * num_warps`` (BLOCK 64 always).
    Raises ``ValueError`` for an unknown kernel name.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "orthogonalize":
        r = padded_rank(max_rank)
        return [
            dict(BLOCK=b, num_warps=w, num_stages=1)
            for b in (64, 128, 256, 512)
            for w in (4, 8)
            if b * r <= MAX_ORTHO_TILE_PER_WARP * w or b == 64
        ]
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
        return dict(BLOCK=256 if max_rank <= 8 else 64, num_warps=4, num_stages=1)
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


def orthogonalize(x, layout: BucketLayout, which: str, epsilon: float, out, *, config: Optional[dict] = None) -> None:
    """One launch: Gram-Schmidt on every P_i (``which="p"``) or Q_i (``"q"``), one program per matrix."""
    cfg = _resolve("orthogonalize", layout, x.dtype, config)
    rows_col, off_col = (1, 5) if which == "p" else (2, 6)
    _orthogonalize_kernel[(layout.num_matrices,)](
        x, out, layout.table, float(epsilon),
        ROWS_COL=rows_col, OFF_COL=off_col, R=padded_rank(layout.max_rank), BLOCK=cfg["BLOCK"],
        **_launch_options(cfg),
    )


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
        return dict(x_ptr=f, out_ptr=f, table_ptr=i64, eps="fp32")
    return dict(
        buf_ptr=g, p_ptr=f, q_ptr=f, lf_ptr=f, e_ptr=f, flag_ptr="*u8", table_ptr=i64, tiles_ptr=i32, scale="fp32"
    )


def _constexprs(kernel: str, config: dict, max_rank: int, variant: dict) -> dict:
    use_dot = config.get("USE_DOT", False)
    c = {"R": padded_rank(max_rank, use_dot)}
    if kernel == "orthogonalize":
        c.update(BLOCK=config["BLOCK"], ROWS_COL=variant.get("ROWS_COL", 1), OFF_COL=variant.get("OFF_COL", 5))
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

    ``variant`` sets the feature constexprs (``HAS_ERROR``, ``HAS_FLAG``, ``ROWS_COL``/``OFF_COL``). Must run with
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
    if kernel == "orthogonalize":
        return [dict(ROWS_COL=1, OFF_COL=5), dict(ROWS_COL=2, OFF_COL=6)]
    if kernel == "project_t":
        return [dict(SPLIT_ROWS=0), dict(SPLIT_ROWS=DEFAULT_SPLIT_ROWS)]
    if kernel == "copy_segments":
        return [dict(to_packed=True), dict(to_packed=False)]
    if kernel == "commit_factor":
        return [dict(ROWS_COL=1, OFF_COL=5), dict(ROWS_COL=2, OFF_COL=6)]
    return [dict()]
