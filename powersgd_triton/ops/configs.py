"""Config spaces and untuned heuristic configs of every tuned kernel.

A config is a dict of the kernel's block sizes plus ``num_warps``/``num_stages`` (and optionally ``maxnreg``, the
registers per thread ptxas may use: a compile option, passed at launch and to
:func:`~tools.aot_compile.compile_aot`):

=================  ===================================================
kernel             keys
=================  ===================================================
``project``        ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``PREFETCH`` further steps
                   in flight (``CARRY``: as a loop-carried copy), ``USE_DOT``
``project_t``      ``BLOCK_M`` columns per tile, ``BLOCK_K`` rows per step, ``PREFETCH`` further steps
                   in flight (broadcast path), ``SPLIT_ROWS`` rows per program at most (0: no split),
                   ``USE_DOT``, ``SPLIT_BF16`` (with ``USE_DOT`` on 2-byte gradients: bfloat16 tensor-core
                   dots on exactly split operands instead of the float32 FMA dot), ``PROGRAMS_PER_SM``
                   the row splits aim at (default: from ``maxnreg``, else ``PROJECT_T_PROGRAMS_PER_SM``)
``orthogonalize``  ``BLOCK`` rows per tile, ``SHORT_ROWS`` most rows of a factor whose Gram one program
                   computes (taller ones are split: two launches), ``APPLY_ROWS`` (optional, default
                   ``SHORT_ROWS``) rows such a program writes, ``GRAM_ROWS`` rows per float64 Gram slot of a
                   split factor (with ``min(BLOCK, ORTHO_GRAM_BLOCK)`` it fixes the summation order),
                   ``SPLIT_ROWS`` rows per program of the apply pass of a split factor
``reconstruct``    ``BLOCK_N`` rows per tile, ``BLOCK_K`` columns per step, ``PREFETCH`` further steps
                   in flight (``CARRY``: as a loop-carried copy), ``USE_DOT``
=================  ===================================================

:func:`config_space` lists the candidates the autotuner times, :func:`heuristic_config` the untuned default (the
tables of :mod:`.lowrank_configs` and :mod:`.ortho_configs`), and
:data:`~powersgd_triton.ops.launch_common.INTERPRETER_CONFIGS` the one config used under ``TRITON_INTERPRET=1``.
"""

import itertools
from typing import List, Optional

import torch

from powersgd_triton.compat import env as _env
from powersgd_triton.layout import KERNELS, MIN_DOT_RANK, BucketLayout, padded_rank
from powersgd_triton.ops.launch_common import INTERPRETER_CONFIGS, _tile_key, device_sms
from powersgd_triton.ops.lowrank_configs import (
    _BROADCAST_TILES, _DEPTHS, _DOT_TILES, _SPLIT_DOT_TILES, BROADCAST_ELEMENTS_PER_THREAD, PROJECT_T_BATCHED_TILE, PROJECT_T_FP32_DOT_CONFIG, PROJECT_T_SPLIT_CONFIG, PROJECT_T_SPLIT_MIN_RANK, PROJECT_T_TILES, PROJECT_TILES, RECONSTRUCT_TILES, TILE_ELEMENTS_PER_THREAD, _broadcast_config, _project_t_broadcast_configs, broadcast_tile, DOT_CONFIG, dot_config, project_t_batched_tile,
)
from powersgd_triton.ops.ortho_configs import _ortho_configs, _ortho_heuristic


def config_space(kernel: str, max_rank: int, dtype: torch.dtype) -> List[dict]:
    """Candidate configs the autotuner times for ``kernel`` at this rank and gradient dtype.

    Broadcast-multiply tiles are kept while ``tile * BLOCK_K * R <= 16 * 32 * num_warps`` (16 accumulator elements
    per thread) and ``tile * BLOCK_K <= 8 * 32 * num_warps``; ``tl.dot`` tiles are offered from
    rank 8 on (below that, padding r to 16 only multiplies the FMAs).
    Every broadcast tile comes with ``num_stages`` 1, 2 and 3, and with ``PREFETCH`` 1 and 2 (the kernel loads the
    tiles of the next one or two loop steps before this step's arithmetic: 2 or 3 steps of loads in flight); every
    ``tl.dot`` tile with ``num_stages`` 1, 2 and 3 (Triton's software pipelining of the loads feeding the dot);
    project_t on 2-byte gradients also the split tensor-core tiles (``SPLIT_BF16``, ``_SPLIT_DOT_TILES``) with
    ``num_stages`` 3, their row splits aiming at 3 or 6 programs per SM (``PROGRAMS_PER_SM``).
    project_t's broadcast path (R <= 8) instead: its heuristic tiles for 4- and 2-byte gradients
    (:data:`PROJECT_T_TILES`) and for the batched view (:data:`PROJECT_T_BATCHED_TILE`), and the tiles of
    ``_PROJECT_T_TILES`` with ``PREFETCH`` 0-2 and ``maxnreg`` 96 or 128 whose held data fits (see there).
    project's and reconstruct's broadcast paths (R <= 8) also have their heuristic tiles (:data:`PROJECT_TILES`,
    :data:`RECONSTRUCT_TILES`, for 4- and 2-byte gradients).
    Orthogonalize: the heuristics of every rank, at their own warps and at 8 (4 where they have 8), whose float64
    tile fits (:func:`_ortho_configs`).
    The row or column splits are not part of a config: they are planned per bucket from the GPU's SM count.
    Raises ``ValueError`` for an unknown kernel name.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "orthogonalize":
        return _ortho_configs(padded_rank(max_rank))
    tile = _tile_key(kernel)
    out = []
    r = padded_rank(max_rank)
    if kernel == "project_t":
        out = _project_t_broadcast_configs(r)
    if kernel in ("project", "reconstruct") and r <= 8:  # their heuristic tiles for 4- and 2-byte gradients
        table = PROJECT_TILES if kernel == "project" else RECONSTRUCT_TILES
        for es in (4, 2):  # this Triton's heuristic tile (OLDER_TRITON_TILES), and the table's
            for entry in (broadcast_tile(kernel, table, r, es), table[(r, es)]):
                cfg = _broadcast_config(kernel, *entry)
                if cfg not in out:
                    out.append(cfg)
    for (bt, bk), warps, (stages, prefetch) in itertools.product(_BROADCAST_TILES.get(kernel, ()), (4, 8), _DEPTHS):
        if bt * bk * r > BROADCAST_ELEMENTS_PER_THREAD * 32 * warps or bt * bk > TILE_ELEMENTS_PER_THREAD * 32 * warps:
            continue
        cfg = {tile: bt, "BLOCK_K": bk, "USE_DOT": False, "num_warps": warps, "num_stages": stages}
        out.append(dict(cfg, PREFETCH=prefetch) if prefetch else cfg)
    if r >= 8:  # the padded rank, as the heuristic reads it (ranks 5-7 take R 8's configs)
        for (bt, bk), stages in itertools.product(_DOT_TILES, (1, 2, 3)):
            if kernel == "project_t":
                bt, bk = bk, bt  # BLOCK_M columns x BLOCK_K rows; tl.dot needs both >= 16
            out.append({tile: bt, "BLOCK_K": bk, "USE_DOT": True, "num_warps": 4, "num_stages": stages})
        if kernel == "reconstruct" and r >= MIN_DOT_RANK:  # this Triton's heuristic (OLDER_TRITON_DOT)
            for es in (4, 2):
                cfg = dot_config(kernel, r, es, DOT_CONFIG)
                if cfg not in out:
                    out.append(cfg)
        if kernel == "project_t" and dtype.itemsize == 2:  # the split bfloat16 tensor-core dots
            for (bm, bk), pps in itertools.product(_SPLIT_DOT_TILES, (3, 6)):
                out.append({"BLOCK_M": bm, "BLOCK_K": bk, "USE_DOT": True, "SPLIT_BF16": True, "PROGRAMS_PER_SM": pps,
                            "num_warps": 4, "num_stages": 3})
    if not out:  # very large rank: smallest broadcast tile
        out.append({tile: 4 if kernel != "project_t" else 32, "BLOCK_K": 16 if kernel != "project_t" else 2,
                    "USE_DOT": False, "num_warps": 4, "num_stages": 2})
    return out


def heuristic_config(kernel: str, layout: Optional[BucketLayout], dtype: torch.dtype,
                     num_sms: Optional[int] = None) -> dict:
    """Untuned default for ``kernel``: the interpreter config under TRITON_INTERPRET=1, else a GPU heuristic.

    GPU heuristic (sized with :mod:`powersgd_triton.perfmodel` for an H100/H200): at rank <= 8 the broadcast
    multiply with the kernels' unrolled register prefetch (Triton does not pipeline these loops) and tiles per
    padded rank and gradient element size (``dtype.itemsize`` 4, else 2) with ``maxnreg`` (no spills, <= 128
    registers on sm_90): project takes :data:`PROJECT_TILES` (4-8 rows x 64-128 columns per step, ``PREFETCH`` 2;
    rank 8 in 2-byte gradients 8 x 32 with ``PREFETCH`` 2 at 96 registers); reconstruct :data:`RECONSTRUCT_TILES`
    (``PREFETCH`` 2, ``maxnreg`` 128; rank 1 in 2-byte gradients the loop-carried ``CARRY`` form); project_t
    :data:`PROJECT_T_TILES` (wide column tiles, a ``[R, BLOCK_M]`` accumulator, 2-3 steps of loads in flight,
    ``maxnreg`` for 4-7 blocks per SM; rank 8 one step of 8 rows), on the batched view :data:`PROJECT_T_BATCHED_TILE`. ``tl.dot`` tiles from rank 16
    on, software-pipelined (``num_stages`` 3; project at rank 32: 32 columns, 2 stages, no spills); project_t on
    2-byte gradients from rank 8 on (:data:`PROJECT_T_SPLIT_MIN_RANK`: R padded to 16) takes
    :data:`PROJECT_T_SPLIT_CONFIG` (bfloat16 tensor-core dots on exactly split operands,
    :func:`split_bf16_dot`), but on the batched view, whose padding error keeps the float32 dot
    (:func:`padding_error_config`). The row and column splits are planned at launch from the SM count
    (:func:`split_rows`, :func:`split_cols`, :func:`plan`); ``num_sms`` is kept for the signature. Returns a new
    dict; raises ``ValueError`` for an unknown kernel name.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if _env.interpreter_enabled():
        return dict(INTERPRETER_CONFIGS[kernel])
    max_rank = layout.max_rank if layout is not None else 4
    if kernel == "orthogonalize":
        return _ortho_heuristic(padded_rank(max_rank))
    r = padded_rank(max_rank)
    if (kernel == "project_t" and r >= PROJECT_T_SPLIT_MIN_RANK and dtype.itemsize == 2
            and not getattr(layout, "batched", False)):  # split_bf16_dot's tensor cores (R padded to 16)
        return dict(PROJECT_T_SPLIT_CONFIG)
    es = 4 if dtype.itemsize >= 4 else 2  # the tile tables' element-size column (runs at every launch: no tensor)
    if r >= MIN_DOT_RANK:
        if kernel == "project_t":  # (2-byte gradients took the split path above)
            return dict(PROJECT_T_FP32_DOT_CONFIG)
        if kernel == "project" and r <= 16:  # 64 columns per step: 188 registers, no spills (sm_90); 128 spill
            return {"BLOCK_N": 16, "BLOCK_K": 64, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
        # (OLDER_TRITON_DOT: triton <= 3.6 takes reconstruct's R 32 fp32 at 16 columns per step)
        return dot_config(kernel, r, es, DOT_CONFIG)
    if kernel == "project_t":
        if getattr(layout, "batched", False):
            return _broadcast_config("project_t", *project_t_batched_tile(r, es))
        return _broadcast_config("project_t", *broadcast_tile("project_t", PROJECT_T_TILES, r, es))
    if kernel == "project":
        return _broadcast_config("project", *broadcast_tile("project", PROJECT_TILES, r, es))
    return _broadcast_config("reconstruct", *broadcast_tile("reconstruct", RECONSTRUCT_TILES, r, es))


def _resolve(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict]) -> dict:
    if config is None:
        return heuristic_config(kernel, layout, dtype, device_sms(layout.device))
    return config
