"""What every Triton launcher shares: the SM count, launch options, loop steps per trip and small table helpers.

The bottom room of the launchers (:mod:`.lowrank_launch`, :mod:`.ortho_launch`, :mod:`.segments_launch`); it
imports no kernel and no other launcher module. :data:`INTERPRETER_CONFIGS` is the one config per kernel used
under ``TRITON_INTERPRET=1`` (large blocks: the interpreter's cost grows with programs x loop steps).
"""

from typing import Dict

import torch

from powersgd_triton.layout import COLS, P_OFF, Q_OFF, ROWS, BucketLayout, padded_rank

# The kernels that stream the bucket (the ones the performance targets are about).
STREAMING_KERNELS = ("project", "project_t", "reconstruct")


# The tile plans aim at this many programs per SM (>= 2: while one program waits for memory another issues loads).
PROGRAMS_PER_SM = 2


# SM count used for plans when the device has none to ask (CPU, interpreter): 1 keeps interpreted grids small. The
# GPU's own count is read from CUDA (132 on H100/H200).
DEFAULT_NUM_SMS = 1


INTERPRETER_CONFIGS: Dict[str, dict] = {
    "project": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "project_t": dict(BLOCK_M=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
    "orthogonalize": dict(BLOCK=256, SHORT_ROWS=4096, GRAM_ROWS=256, SPLIT_ROWS=256, num_warps=4, num_stages=1),
    "reconstruct": dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=False, num_warps=4, num_stages=1),
}


def _tile_key(kernel: str) -> str:
    return "BLOCK_M" if kernel == "project_t" else "BLOCK_N"


def device_sms(device) -> int:
    """SM count of ``device`` (CUDA), else :data:`DEFAULT_NUM_SMS`."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_NUM_SMS


def _launch_options(cfg: dict) -> dict:
    """Triton launch options of a config (``num_warps``, ``num_stages``, ``maxnreg``). Raises ``ValueError`` for a
    ``PREFETCH`` other than 0, 1 or 2 (the kernels unroll at most three register sets; the plans count trips of
    ``1 + PREFETCH`` steps)."""
    _check_prefetch(cfg)
    out = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 1)}
    if cfg.get("maxnreg"):
        out["maxnreg"] = cfg["maxnreg"]
    return out


def _pow2_split(work_per_program: float, align: int, extent: int) -> int:
    """Largest ``align * 2**k`` <= ``work_per_program`` (at least ``2 * align``: a few loop trips), so that the
    bucket gets at least the target number of programs; 0 (no split) when that is >= ``extent``."""
    split = 2 * align
    while split * 2 <= work_per_program:
        split *= 2
    return 0 if split >= extent else split


def _check_prefetch(cfg: dict) -> int:
    prefetch = cfg.get("PREFETCH", 0)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or not 0 <= prefetch <= 2:
        raise ValueError(f"config PREFETCH must be 0, 1 or 2, got {prefetch!r}")
    return prefetch


def steps_per_trip(cfg: dict) -> int:
    """Loop steps (``BLOCK_K`` rows of project_t, columns of project and reconstruct) one trip of the kernel's loop
    does: ``1 + PREFETCH`` on the broadcast path (the loop is unrolled once per step in flight), 1 with ``tl.dot``
    (project's ``PREFETCH`` there is the loop-carried form) or the loop-carried ``CARRY`` form. Raises
    ``ValueError`` for a ``PREFETCH`` other than 0, 1 or 2."""
    prefetch = _check_prefetch(cfg)
    return 1 if cfg.get("USE_DOT") or cfg.get("CARRY") else 1 + prefetch


def factor_columns(which: str) -> dict:
    """The layout-table columns of factor ``which`` ("p" or "q") as the constexprs of the commit_factor kernel:
    ``ROWS_COL`` (its row count: ``ROWS`` n for P, ``COLS`` m for Q) and ``OFF_COL`` (its offset in the flat factor:
    ``P_OFF``, ``Q_OFF``). Raises ``ValueError`` for another ``which``."""
    if which == "p":
        return dict(ROWS_COL=ROWS, OFF_COL=P_OFF)
    if which == "q":
        return dict(ROWS_COL=COLS, OFF_COL=Q_OFF)
    raise ValueError(f"which must be 'p' or 'q', got {which!r}")


def _factor_rank(layout: BucketLayout, cfg: dict) -> int:
    return padded_rank(layout.max_rank, cfg.get("USE_DOT", False))


def _flag_bytes(flags):
    if flags.dtype == torch.bool:
        return flags.view(torch.uint8)
    return flags
