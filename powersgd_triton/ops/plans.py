"""The launch plan of the streaming and elementwise bucket steps as the performance model reads it: :func:`plan`
(programs, loop trips per program, DRAM and L2 bytes, FMA and tensor-core work of every launch of ``project``,
``project_t`` (+ ``reduce_splits``), ``reconstruct``, ``average`` and ``copy_segments``; ``project`` with the
``PACK`` variant: its pack programs too, the packed bytes in its bytes).

It describes what the launchers do, from the same splits and configs they use (:func:`.projection_t.split_rows`,
:func:`.reconstruction.split_cols`, :func:`.configs.heuristic_config`); orthogonalize's plan is
:func:`.orthogonalization.orthogonalize_plan`. Nothing is launched here.
"""

from typing import List, Optional

import torch

from powersgd_triton.layout import KERNELS, BucketLayout
from powersgd_triton.ops.aligned import aligned_width
from powersgd_triton.ops.configs import SPLIT_DOTS, SPLIT_OPS_M, SPLIT_OPS_P, heuristic_config, padding_error_config, split_bf16_dot
from powersgd_triton.ops.launch import _factor_rank, device_sms, steps_per_trip
from powersgd_triton.ops.projection_t import reduce_block_m, reduce_split_block, split_rows
from powersgd_triton.ops.reconstruction import split_cols
from powersgd_triton.ops.segments import (
    AVERAGE_BLOCK, AVERAGE_ITERS, SEGMENT_BLOCK, SEGMENT_ITERS, SEGMENT_WARPS, chunk_alignment,
)


def plan(kernel: str, layout: BucketLayout, dtype: torch.dtype, config: Optional[dict] = None, *,
         num_sms: Optional[int] = None, variant: Optional[dict] = None) -> List[dict]:
    """The launches of one bucket step ``kernel`` on ``layout``, as the performance model reads them.

    Returns a list of dicts (one per launch) with keys ``kernel`` (a name of :data:`~powersgd_triton.ops.kernels.KERNEL_FUNCTIONS`),
    ``programs``, ``iterations`` (most loop trips of one program), ``bytes_read``, ``bytes_written`` (DRAM bytes,
    each element once), ``config`` and ``variant`` (what :func:`tools.aot_compile.compile_aot` needs), plus ``dtype``, ``max_rank``,
    ``flops`` (work of the FMA pipe: multiply-adds x 2 on the padded rank; on project_t's split tensor-core path,
    :func:`split_bf16_dot`, its operand splits instead, 2 per instruction, :data:`SPLIT_OPS_P` /
    :data:`SPLIT_OPS_M`), ``tensor_flops`` (project_t: multiply-adds x 2 done on tensor cores, every dot of the
    split path counted; 0 elsewhere or absent) and ``l2_bytes`` (factor bytes re-read by several programs, served
    by L2). ``kernel`` is one of ``project``, ``project_t``, ``reconstruct``, ``average``, ``copy_segments``;
    ``orthogonalize`` is :func:`powersgd_triton.ops.orthogonalization.orthogonalize_plan`. ``num_sms`` sizes the splits (default: the layout's device).
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
    if kernel in ("project", "project_t", "reconstruct") and "ALIGN" not in variant:
        variant["ALIGN"] = aligned_width(layout, dtype, cfg, kernel)  # what the launcher passes (0: the masked path)
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
        unc = 0
        if variant.get("PACK"):  # the pack programs after the tiles: num_warps chunks each, one trip per 256 elements
            variant.setdefault("PACK_ALIGN", chunk_alignment(layout))
            rows, block = cfg.get("num_warps", 4), SEGMENT_BLOCK * SEGMENT_ITERS
            # segments.pack_chunks' counts, from the layout's ranges (the model's layouts live on the meta device)
            counts = [min(block, n - c) for _, n in layout.uncompressed for c in range(0, n, block)]
            # a trip of the pack loop counted as one loop step of project's (the issue term's unit: an over-estimate)
            per += [-(-max(counts[i:i + rows]) // SEGMENT_BLOCK) for i in range(0, len(counts), rows)]
            unc = layout.uncompressed_numel * es
        programs = len(per)
        return [dict(base, kernel="project", programs=programs, iterations=max(per), program_iterations=per,
                     steps_per_trip=steps,
                     bytes_read=mn * es + (4 * e_numel if err else 0) + q4 + unc,
                     bytes_written=(mn * es if err else 0) + p4 * (2 if variant.get("HAS_P2") else 1) + unc,
                     flops=2 * R * sum(s.n * s.m for s in mats),
                     l2_bytes=sum(-(-s.n // bn) * s.m * s.rank * 4 for s in mats))]
    if kernel == "project_t":
        cfg = base["config"] = padding_error_config(cfg, variant.get("PAD_ERROR", False))
        R = _factor_rank(layout, cfg)
        bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
        split = split_rows(layout, cfg, num_sms)
        steps = steps_per_trip(cfg)
        if variant["ALIGN"] and not cfg["USE_DOT"]:  # the aligned path: a step is one row, BLOCK_K of them per trip
            bk, steps = 1, bk
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
        if "ALIGN" not in variant:  # what the launcher passes: chunks at multiples of 16 bytes of 2-byte data
            variant["ALIGN"] = chunk_alignment(layout, which if kernel == "average" else "")
        factor = 0 if kernel == "copy_segments" else (layout.p_numel if which == "p" else layout.q_numel)
        unc = layout.uncompressed_numel
        if kernel == "average" and "RECIP" not in variant:  # a power-of-two world size (the launcher's test)
            variant["RECIP"] = True
        sub, iters, warps = ((AVERAGE_BLOCK, AVERAGE_ITERS, 4) if kernel == "average"
                             else (SEGMENT_BLOCK, SEGMENT_ITERS, SEGMENT_WARPS))
        block = sub * iters
        spans = [(s.n if which == "p" else s.m) * s.rank for s in mats] if factor else []
        spans += [n for _, n in layout.uncompressed]
        # per program (tile-table order): loop trips over its chunk's sub-blocks of `sub` elements
        per = [-(-min(block, n - c) // sub) for n in spans for c in range(0, n, block)]
        programs = len(per)
        # global loads one step issues per thread (the bucket's dtype; the factor is read in it too on the 16-bit
        # hooks): the compiler unrolls these short loops, a trip of the compiled loop is (its loads / these) steps
        step_loads = sub // (32 * warps) // (16 // es if variant["ALIGN"] else 1)
        return [dict(base, kernel=kernel, programs=programs, iterations=max(per, default=1), program_iterations=per,
                     step_loads=max(1, step_loads), bytes_read=4 * factor + unc * es,
                     bytes_written=4 * factor + unc * es + (programs if kernel == "average" else 0),
                     flops=0, l2_bytes=0, config=dict(BLOCK=block, num_warps=warps, num_stages=1))]
    raise ValueError(f"no plan for kernel {kernel!r}")

