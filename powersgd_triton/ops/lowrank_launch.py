"""Launchers and launch plans of the streaming kernels: ``project``, ``project_t`` (+ ``reduce_splits``) and
``reconstruct``; :func:`plan` also covers ``average`` and ``copy_segments`` for the performance model.

Each launcher issues exactly ONE kernel launch for the whole bucket (project_t a second, ``reduce_splits``, when
the plan splits a matrix over rows), so a PowerSGD step costs a constant number of launches whatever the number of
matrices L. Shapes and dtypes are those of :mod:`powersgd_triton.ops`, which validates its inputs before calling
here. The row and column splits are planned per bucket from the GPU's SM count (:func:`split_rows`,
:func:`split_cols`); the configs come from :mod:`.configs`.
"""

from typing import List, Optional

import torch

from powersgd_triton.compat.versions import DirectLaunch
from powersgd_triton.layout import KERNELS, BucketLayout
from powersgd_triton.ops.configs import _resolve, heuristic_config
from powersgd_triton.ops.launch_common import (
    PROGRAMS_PER_SM, _factor_rank, _launch_options, _pow2_split, device_sms, steps_per_trip,
)
from powersgd_triton.ops.lowrank_configs import (
    PROJECT_T_PROGRAMS_PER_SM, REDUCE_MAX_SPLITS, REDUCE_STEP_ELEMENTS, REDUCE_TILE_ELEMENTS, SPLIT_DOTS, SPLIT_OPS_M, SPLIT_OPS_P, padding_error_config, split_bf16_dot,
)
from powersgd_triton.ops.lowrank_mm import _project_kernel, _project_t_kernel, _reduce_splits_kernel
from powersgd_triton.ops.occupancy import blocks_per_sm
from powersgd_triton.ops.reconstruction import _reconstruct_kernel
from powersgd_triton.ops.segments_launch import AVERAGE_BLOCK, SEGMENT_BLOCK


def project_t_programs_per_sm(cfg: dict) -> int:
    """Programs per SM project_t's row splits aim at: ``cfg["PROGRAMS_PER_SM"]`` if given, else the blocks of
    ``num_warps`` warps that fit on one SM at ``cfg["maxnreg"]`` registers per thread (the compile's cap: one round
    of resident programs), else :data:`PROJECT_T_PROGRAMS_PER_SM`."""
    if cfg.get("PROGRAMS_PER_SM"):
        return max(1, int(cfg["PROGRAMS_PER_SM"]))
    if cfg.get("maxnreg"):
        return max(1, blocks_per_sm(int(cfg["maxnreg"]), int(cfg.get("num_warps", 4)), 0, 90)["blocks_per_sm"])
    return PROJECT_T_PROGRAMS_PER_SM


def split_rows(layout: BucketLayout, cfg: dict, num_sms: int) -> int:
    """Rows per project_t program: ``cfg["SPLIT_ROWS"]`` if given, else planned from the SM count (0: no split).

    The target is ``project_t_programs_per_sm(cfg) * num_sms`` programs (one round of resident programs). When the
    column tiles alone reach it, no split, unless one matrix is much taller than the rest (then rows of about
    work / target). Else the smallest multiple of one loop trip's rows (``BLOCK_K * steps per trip``) for which the
    bucket has at most the target: all programs start at once and the longest is as short as the target allows.
    Cached on the layout per tile width, trip rows and target (it runs at every launch).
    """
    if "SPLIT_ROWS" in cfg:
        return int(cfg["SPLIT_ROWS"])
    bm = cfg["BLOCK_M"]
    unit = cfg["BLOCK_K"] * steps_per_trip(cfg)
    target = project_t_programs_per_sm(cfg) * num_sms
    return layout.memo(("split_rows", bm, unit, target), lambda: _plan_split_rows(layout, bm, unit, target))


def _plan_split_rows(layout: BucketLayout, bm: int, unit: int, target: int) -> int:
    shapes = [(s.n, -(-s.m // bm)) for s in layout.matrices]
    tiles = sum(ct for _, ct in shapes)
    work = sum(n * ct for n, ct in shapes)  # rows walked by all column tiles
    tallest = max(n for n, _ in shapes)
    if tiles >= target:
        if tallest * tiles <= 2 * work:  # enough programs and no matrix much longer than the rest
            return 0
        split = -(-int(work / target) // unit) * unit
        return 0 if split >= tallest else max(unit, split)

    def programs(split: int) -> int:
        return sum(ct * -(-n // split) for n, ct in shapes)

    lo, hi = 1, -(-tallest // unit)  # in trips; programs(hi * unit) == tiles <= target
    while lo < hi:
        mid = (lo + hi) // 2
        if programs(mid * unit) <= target:
            hi = mid
        else:
            lo = mid + 1
    split = lo * unit
    return 0 if split >= tallest else split


def split_cols(layout: BucketLayout, cfg: dict, num_sms: int) -> int:
    """Columns per reconstruct program: ``cfg["SPLIT_COLS"]`` if given, else planned like :func:`split_rows`."""
    if "SPLIT_COLS" in cfg:
        return int(cfg["SPLIT_COLS"])
    bn = cfg["BLOCK_N"]
    tiles = sum(-(-s.n // bn) for s in layout.matrices)
    target = PROGRAMS_PER_SM * num_sms
    work = sum(s.m * -(-s.n // bn) for s in layout.matrices)
    widest = max(s.m for s in layout.matrices)
    if tiles >= target and widest * tiles <= 2 * work:
        return 0
    return _pow2_split(work / target, cfg["BLOCK_K"] * steps_per_trip(cfg), widest)


def reduce_block_m(cfg: dict, R: int) -> int:
    """Columns per reduce_splits program for project_t's ``cfg`` at padded rank ``R``: ``REDUCE_TILE_ELEMENTS // R``,
    at most ``BLOCK_M``, at least 1 (a power of two)."""
    return max(1, min(int(cfg["BLOCK_M"]), REDUCE_TILE_ELEMENTS // R))


def reduce_split_block(block_m: int, R: int) -> int:
    """Partial sums of project_t that ``reduce_splits`` loads per step (all in flight at once): a power of two, at
    most :data:`REDUCE_MAX_SPLITS`, with ``SPLIT_BLOCK x block_m x R <= REDUCE_STEP_ELEMENTS`` (32 float32 per
    thread of 4 warps), at least 1."""
    sb = 1
    while sb < REDUCE_MAX_SPLITS and 2 * sb * block_m * R <= REDUCE_STEP_ELEMENTS:
        sb *= 2
    return sb


def plan(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict] = None, *,
         num_sms: Optional[int] = None, variant: Optional[dict] = None) -> List[dict]:
    """The launches of one bucket step ``kernel`` on ``layout``, as the performance model reads them.

    Returns a list of dicts (one per launch) with keys ``kernel`` (a name of :data:`KERNEL_FUNCTIONS`),
    ``programs``, ``iterations`` (most loop trips of one program), ``bytes_read``, ``bytes_written`` (DRAM bytes,
    each element once), ``config`` and ``variant`` (what :func:`compile_aot` needs), plus ``dtype``, ``max_rank``,
    ``flops`` (work of the FMA pipe: multiply-adds x 2 on the padded rank; on project_t's split tensor-core path,
    :func:`split_bf16_dot`, its operand splits instead, 2 per instruction, :data:`SPLIT_OPS_P` /
    :data:`SPLIT_OPS_M`), ``tensor_flops`` (project_t: multiply-adds x 2 done on tensor cores, every dot of the
    split path counted; 0 elsewhere or absent) and ``l2_bytes`` (factor bytes re-read by several programs, served
    by L2). ``kernel`` is one of ``project``, ``project_t``, ``reconstruct``, ``average``, ``copy_segments``;
    ``orthogonalize`` is :func:`orthogonalize_plan`. ``num_sms`` sizes the splits (default: the layout's device).
    """
    if config is not None:
        cfg = dict(config)
    elif kernel in KERNELS:
        cfg = heuristic_config(kernel, layout, dtype, num_sms)
    else:
        cfg = {}
    if num_sms is None:
        num_sms = device_sms(layout.device)
    variant = dict(variant or {})
    es = torch.empty((), dtype=dtype).element_size()
    mats = layout.matrices
    mn = sum(s.numel for s in mats)
    e_numel = layout.e_numel
    p4, q4 = 4 * layout.p_numel, 4 * layout.q_numel
    base = dict(config=cfg, variant=variant, dtype=str(dtype).replace("torch.", ""), max_rank=layout.max_rank)
    if kernel == "project":
        R = _factor_rank(layout, cfg)
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        err = variant.get("HAS_ERROR", True)
        steps = steps_per_trip(cfg)
        # tile-table order; whole trips of the loop (the last trip's extra steps are masked)
        per = [-(-s.m // (bk * steps)) * steps for s in mats for _ in range(-(-s.n // bn))]
        programs = len(per)
        return [dict(base, kernel="project", programs=programs, iterations=max(per), program_iterations=per,
                     steps_per_trip=steps,
                     bytes_read=mn * es + (4 * e_numel if err else 0) + q4,
                     bytes_written=(mn * es if err else 0) + p4 * (2 if variant.get("HAS_P2") else 1),
                     flops=2 * R * sum(s.n * s.m for s in mats),
                     l2_bytes=sum(-(-s.n // bn) * s.m * s.rank * 4 for s in mats))]
    if kernel == "project_t":
        cfg = base["config"] = padding_error_config(cfg, variant.get("PAD_ERROR", False))
        R = _factor_rank(layout, cfg)
        bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
        split = split_rows(layout, cfg, num_sms)
        steps = steps_per_trip(cfg)
        per, ws, red, red_per = [], 0, 0, []

        def loop_steps(rows):  # steps the loop runs: whole trips (the last one's extra steps are masked)
            return -(-rows // (bk * steps)) * steps

        for s in mats:  # project_t_tiles' order: per column tile, its row splits
            ns = -(-s.n // split) if split and s.n > split else 1
            ct = -(-s.m // bm)
            for _ in range(ct):
                per += [loop_steps(min(s.n, (k + 1) * split) - k * split) for k in range(ns)] if ns > 1 else [
                    loop_steps(s.n)]
            if ns > 1:
                ws += ns * s.m * s.rank * 4
                rt = -(-s.m // reduce_block_m(cfg, R))
                red += rt
                red_per += [ns] * rt
        programs, iters = len(per), max(per)
        products = 2 * R * sum(s.n * s.m for s in mats)
        if split_bf16_dot(cfg, dtype, variant):  # tensor-core dots; the FMA pipe only splits the operands
            flops = 2 * SPLIT_OPS_P * R * sum(-(-s.m // bm) * s.n for s in mats)
            flops += 2 * SPLIT_OPS_M.get(dtype, 0) * mn
            tensor = SPLIT_DOTS[dtype] * products
        else:
            flops, tensor = products, 0
        out = [dict(base, kernel="project_t", programs=programs, iterations=iters, program_iterations=per,
                    steps_per_trip=steps,
                    bytes_read=mn * es + p4, bytes_written=q4 + ws,
                    flops=flops, tensor_flops=tensor,
                    l2_bytes=sum(-(-s.m // bm) * s.n * s.rank * 4 for s in mats), split_rows=split)]
        if red:
            sb = reduce_split_block(reduce_block_m(cfg, R), R)
            red_per = [-(-ns // sb) for ns in red_per]
            out.append(dict(base, kernel="reduce_splits", programs=red, iterations=max(red_per),
                            program_iterations=red_per, bytes_read=ws, bytes_written=q4,
                flops=0, l2_bytes=0))
        return out
    if kernel == "reconstruct":
        R = _factor_rank(layout, cfg)
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        split = split_cols(layout, cfg, num_sms)
        err = variant.get("HAS_ERROR", True)
        steps = steps_per_trip(cfg)
        per = []
        for s in mats:  # reconstruct_tiles' order: per row block, its column ranges (whole trips of the loop)
            chunk = split if 0 < split < s.m else s.m
            per += [-(-(min(s.m, c + chunk) - c) // (bk * steps)) * steps
                    for c in range(0, s.m, chunk)] * -(-s.n // bn)
        programs, iters = len(per), max(per)
        commit = {1: p4, 2: q4}.get(variant.get("COMMIT", 0), 0)
        local = {1: p4, 2: q4}.get(variant.get("LOCAL_ERR", 0), 0)
        return [dict(base, kernel="reconstruct", programs=programs, iterations=iters, program_iterations=per,
                     bytes_read=p4 + q4 + local + ((mn * es + (e_numel - mn) * 4) if err else 0),
                     bytes_written=mn * es + (4 * e_numel if err else 0) + commit,
                     flops=2 * R * sum(s.n * s.m for s in mats) * (2 if local else 1),
                     l2_bytes=programs * bn * R * 4 + sum(-(-s.n // bn) * s.m * s.rank * 4 for s in mats),
                     split_cols=split, steps_per_trip=steps)]
    if kernel in ("average", "copy_segments"):
        which = variant.get("which", "q")
        factor = 0 if kernel == "copy_segments" else (layout.p_numel if which == "p" else layout.q_numel)
        unc = layout.uncompressed_numel
        block = AVERAGE_BLOCK if kernel == "average" else SEGMENT_BLOCK
        programs = sum(-(-n // block) for _, n in layout.uncompressed)
        programs += sum(-(-((s.n if which == "p" else s.m) * s.rank) // block) for s in mats) if factor else 0
        return [dict(base, kernel=kernel, programs=programs, iterations=1, bytes_read=4 * factor + unc * es,
                     bytes_written=4 * factor + unc * es + (programs if kernel == "average" else 0),
                     flops=0, l2_bytes=0, config=dict(BLOCK=block, num_warps=4, num_stages=1))]
    raise ValueError(f"no plan for kernel {kernel!r}")


def project(buffer, layout: BucketLayout, q, p, error=None, *, p2=None, loss_scale=None,
            config: Optional[dict] = None) -> None:
    """One launch: ``P_i = (M_i [+ s·E_i]) · Q_i`` for all i (see :func:`powersgd_triton.ops.project`); ``p2``: a
    second copy of P written by the same launch; ``loss_scale``: the one-element float32 ``s`` (else ``s = 1``).
    The launch plan (config, tiles, grid, constexprs, the compiled kernel:
    :class:`~powersgd_triton.compat.versions.DirectLaunch`) is built once per layout, config and variant."""
    key = ("launch:project", buffer.dtype, None if config is None else tuple(config.items()), error is not None,
           p2 is not None, loss_scale is not None)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _project_launch(layout, buffer.dtype, config, *key[3:]))
    launch, tiles = plan
    launch(buffer, q, p, p2 if p2 is not None else p, error if error is not None else p, layout.table, tiles,
           loss_scale if loss_scale is not None else p)


def _project_launch(layout, dtype, config, has_error, has_p2, has_ls):
    cfg = _resolve("project", layout, dtype, config)
    tiles = layout.tiles("rows", cfg["BLOCK_N"])
    R = _factor_rank(layout, cfg)
    return DirectLaunch(_project_kernel, (tiles.shape[0],), dict(
        HAS_ERROR=has_error, PAD_ERROR=layout.batched and has_error, HAS_P2=has_p2,
        R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0),
        LOSS_SCALE=has_ls and has_error, CARRY=bool(cfg.get("CARRY", False)), **_launch_options(cfg))), tiles


def project_t(buffer, layout: BucketLayout, p, q, *, error=None, q2=None, loss_scale=None,
              config: Optional[dict] = None) -> None:
    """``Q_i = M_iᵀ · P_i`` for all i (see :func:`powersgd_triton.ops.project_t`): one launch, plus one for the
    fixed-order reduction when the plan splits a matrix over rows. ``error``: the batched view's error memory (its
    padding's part is the padding's M + E); ``q2``: a second copy of Q. Launch plans as :func:`project`'s (the row
    splits planned once, from the device's SM count)."""
    pad = layout.batched and error is not None
    key = ("launch:project_t", buffer.dtype, None if config is None else tuple(config.items()), pad, q2 is not None,
           loss_scale is not None)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _project_t_launch(layout, buffer.dtype, config, *key[3:]))
    main, tiles, reduce, reduce_tiles, ws = plan
    q2 = q2 if q2 is not None else q
    main(buffer, p, q, q2, error if pad else p, ws if ws is not None else p, layout.table, tiles,
         loss_scale if loss_scale is not None else p)
    if reduce is not None:
        reduce(ws, q, q2, layout.table, reduce_tiles)


def _project_t_launch(layout, dtype, config, pad, has_q2, has_ls):
    cfg = padding_error_config(_resolve("project_t", layout, dtype, config), pad)
    split = split_rows(layout, cfg, device_sms(layout.device))
    R = _factor_rank(layout, cfg)
    reduce_bm = reduce_block_m(cfg, R)
    tiles, reduce_tiles, ws_numel = layout.project_t_tiles(cfg["BLOCK_M"], split, reduce_bm)
    ws = layout.workspace(ws_numel) if reduce_tiles is not None else None
    main = DirectLaunch(_project_t_kernel, (tiles.shape[0],), dict(
        PAD_ERROR=pad, HAS_Q2=has_q2, R=R, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        USE_DOT=cfg["USE_DOT"], PREFETCH=cfg.get("PREFETCH", 0), LOSS_SCALE=pad and has_ls,
        PADDED=layout.batched, SPLIT_BF16=bool(cfg.get("SPLIT_BF16", False)), **_launch_options(cfg)))
    reduce = None
    if reduce_tiles is not None:
        reduce = DirectLaunch(_reduce_splits_kernel, (reduce_tiles.shape[0],), dict(
            HAS_Q2=has_q2, R=R, BLOCK_M=reduce_bm, SPLIT_BLOCK=reduce_split_block(reduce_bm, R), num_warps=4,
            num_stages=1))
    return main, tiles, reduce, reduce_tiles, ws


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
    commit=None,
    first=None,
    loss_scale=None,
    config: Optional[dict] = None,
) -> None:
    """One launch: ``M_i ← P_i·(scale·Q_i)ᵀ`` and optionally ``E_i ← M_i − P_i·(scale·Q_i)ᵀ`` for all i.

    With ``local_p`` (``local_q``) the error is the local residual ``M_i − P_local·Q_iᵀ`` (``M_i − P_i·Q_localᵀ``).
    ``update_error``: uint8/bool device flags (all must have bit 0 set for the error update). ``commit``:
    ``(which, kept)``: also ``kept_i <- p_i`` (``"p"``) or ``q_i`` (``"q"``) where the step is finite and the
    matrix's flags (``first``, from :meth:`~powersgd_triton.layout.BucketLayout.average_tiles`) say non-zero.
    ``loss_scale``: one-element float32 ``s``; the error is stored divided by it (unscaled units). Launch plans as
    :func:`project`'s (the column splits planned once, from the device's SM count).
    """
    local_err = 1 if local_p is not None else 2 if local_q is not None else 0
    local = local_p if local_p is not None else local_q if local_q is not None else p
    commit_mode, kept = 0, p
    if commit is not None:
        which, kept = commit
        commit_mode = 1 if which == "p" else 2
    key = ("launch:reconstruct", buffer.dtype, None if config is None else tuple(config.items()), error is not None,
           update_error is not None, local_err, commit_mode, loss_scale is not None)
    plan = layout._tiles.get(key)  # the layout's memo (layout.memo), read without a call
    if plan is None:
        plan = layout.memo(key, lambda: _reconstruct_launch(layout, buffer.dtype, config, *key[3:]))
    launch, tiles = plan
    if update_error is not None:
        flags = update_error.reshape(-1)
        if flags.dtype == torch.bool:
            flags = flags.view(torch.uint8)
        n_flags = update_error.numel()
    else:
        flags, n_flags = p, 0
    launch(buffer, p, q, local, error if error is not None else p, kept, flags, first if first is not None else tiles,
           layout.table, tiles, loss_scale if loss_scale is not None else p, n_flags, float(scale))


def _reconstruct_launch(layout, dtype, config, has_error, has_flag, local_err, commit_mode, has_ls):
    cfg = _resolve("reconstruct", layout, dtype, config)
    split = split_cols(layout, cfg, device_sms(layout.device))
    tiles = layout.reconstruct_tiles(cfg["BLOCK_N"], split)
    R = _factor_rank(layout, cfg)
    return DirectLaunch(_reconstruct_kernel, (tiles.shape[0],), dict(
        HAS_ERROR=has_error, HAS_FLAG=has_flag, LOCAL_ERR=local_err, PAD_ERROR=layout.batched and has_error,
        COMMIT=commit_mode, R=R, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], USE_DOT=cfg["USE_DOT"],
        PREFETCH=cfg.get("PREFETCH", 0), LOSS_SCALE=has_ls and has_error, CARRY=bool(cfg.get("CARRY", False)),
        **_launch_options(cfg))), tiles
