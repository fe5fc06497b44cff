"""Ahead-of-time compilation of the bucket kernels for a GPU target on a machine without GPU.

:data:`KERNEL_FUNCTIONS` maps each launch's name to its ``@triton.jit`` function; :func:`compile_aot` compiles
one with a config and feature variant exactly as its launcher would launch it; :func:`variants` lists the
feature-flag combinations each kernel is launched with. Used by :mod:`tools.aot`,
:mod:`powersgd_triton.perfmodel` and the compile tests.
"""

from typing import Dict, Iterable

import torch
import triton

from powersgd_triton.compat import env as _env
from powersgd_triton.layout import COLS, Q_OFF, padded_rank
from powersgd_triton.ops.configs import _ortho_constexprs, _tile_key, padding_error_config
from powersgd_triton.ops.kernels import KERNEL_FUNCTIONS
from powersgd_triton.ops.launch import _launch_options, factor_columns
from powersgd_triton.ops.orthogonalization import _ortho_gram_kernel, _orthogonalize_kernel
from powersgd_triton.ops.projection import _project_kernel
from powersgd_triton.ops.projection_t import _project_t_kernel, _reduce_splits_kernel, reduce_block_m, reduce_split_block
from powersgd_triton.ops.reconstruction import _reconstruct_kernel
from powersgd_triton.ops.segments import AVERAGE_BLOCK, SEGMENT_BLOCK, _average_kernel, _commit_factor_kernel, _copy_segments_kernel



_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _signature(kernel: str, grad_dtype: torch.dtype, wire: bool = False) -> Dict[str, str]:
    """The argument types of a kernel launch on a bucket of ``grad_dtype``; ``wire``: the factor the launch writes
    (project: P, project_t and reduce_splits: Q) or reads (average: Q) is the buffer it is all-reduced in, in the
    communication dtype (here the bucket's: the hooks' default on the Triton backend)."""
    g = "*" + _TRITON_DTYPES[grad_dtype]
    f, i64, i32 = "*fp32", "*i64", "*i32"
    w = g if wire else f
    if kernel == "project":
        return dict(buf_ptr=g, q_ptr=f, p_ptr=w, p2_ptr=w, e_ptr=f, table_ptr=i64, tiles_ptr=i32, ls_ptr=f)
    if kernel == "project_t":
        return dict(buf_ptr=g, p_ptr=f, q_ptr=w, q2_ptr=w, e_ptr=f, ws_ptr=f, table_ptr=i64, tiles_ptr=i32, ls_ptr=f)
    if kernel == "reduce_splits":
        return dict(ws_ptr=f, q_ptr=w, q2_ptr=w, table_ptr=i64, reduce_tiles_ptr=i32)
    if kernel == "copy_segments":
        return dict(src_ptr=g, dst_ptr=f, tiles_ptr=i64, scale="fp32")
    if kernel == "average":
        return dict(f_ptr=w, fo_ptr=f, src_ptr=g, dst_ptr=g, flags_ptr="*u8", tiles_ptr=i64, world="fp32")
    if kernel == "commit_factor":
        return dict(new_ptr=f, kept_ptr=f, flag_ptr="*u8", table_ptr=i64)
    if kernel == "orthogonalize":
        return dict(x_ptr=f, out_ptr=f, ws_ptr="*fp64", tasks_ptr=i64, eps="fp32")
    if kernel == "orthogonalize_gram":
        return dict(x_ptr=f, ws_ptr="*fp64", tasks_ptr=i64)
    return dict(
        buf_ptr=g, p_ptr=f, q_ptr=f, lf_ptr=f, e_ptr=f, kept_ptr=f, flags_ptr="*u8", first_ptr=i32, table_ptr=i64,
        tiles_ptr=i32, ls_ptr=f, n_flags="i32", scale="fp32",
    )


def _constexprs(kernel: str, config: dict, max_rank: int, variant: dict) -> dict:
    use_dot = config.get("USE_DOT", False)
    c = {"R": padded_rank(max_rank, use_dot)}
    if kernel in ("orthogonalize", "orthogonalize_gram"):
        oc = _ortho_constexprs(config, c["R"])
        if kernel == "orthogonalize_gram":
            c.update(BLOCK=oc["GRAM_BLOCK"], GROUP_TILES=oc["GROUP_TILES"])
        else:
            c.update({k: oc[k] for k in ("BLOCK", "CHUNK_TILES", "SHORT_CHUNKS", "APPLY_CHUNKS", "SLOT_BLOCK")})
        return c
    if kernel == "reduce_splits":
        bm = reduce_block_m(config, c["R"])
        c.update(BLOCK_M=bm, HAS_Q2=variant.get("HAS_Q2", False), SPLIT_BLOCK=reduce_split_block(bm, c["R"]))
        return c
    if kernel == "copy_segments":
        return {"BLOCK": SEGMENT_BLOCK}
    if kernel == "average":
        return {"BLOCK": AVERAGE_BLOCK}
    if kernel == "commit_factor":
        return {"BLOCK": 256, "ROWS_COL": variant.get("ROWS_COL", COLS), "OFF_COL": variant.get("OFF_COL", Q_OFF)}
    c.update({k: config[k] for k in (_tile_key(kernel), "BLOCK_K", "USE_DOT")})
    c["PREFETCH"] = config.get("PREFETCH", 0)
    c["PAD_ERROR"] = variant.get("PAD_ERROR", False)
    c["LOSS_SCALE"] = variant.get("LOSS_SCALE", False)
    if kernel == "project":
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
        c["HAS_P2"] = variant.get("HAS_P2", False)
    if kernel == "project_t":
        c["HAS_Q2"] = variant.get("HAS_Q2", False)
        c["PADDED"] = variant.get("PADDED", c["PAD_ERROR"])
        c["SPLIT_BF16"] = bool(config.get("SPLIT_BF16", False))
    if kernel in ("project", "reconstruct"):
        c["CARRY"] = bool(config.get("CARRY", False))
    if kernel == "reconstruct":
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
        c["HAS_FLAG"] = variant.get("HAS_FLAG", True)
        c["LOCAL_ERR"] = variant.get("LOCAL_ERR", 0)
        c["COMMIT"] = variant.get("COMMIT", 0)
    return c


def _compile_args(kernel: str, config: dict, grad_dtype: torch.dtype, max_rank: int, variant=None):
    """(argument types with the constexprs marked, constexprs, launch options) of a launch: what one compile is."""
    if kernel == "project_t":  # what project_t() launches for this variant
        config = padding_error_config(config, (variant or {}).get("PAD_ERROR", False))
    constexprs = _constexprs(kernel, config, max_rank, variant or {})
    signature = dict(_signature(kernel, grad_dtype, bool((variant or {}).get("wire", False))))
    if kernel == "copy_segments" and not (variant or {}).get("to_packed", True):
        signature["src_ptr"], signature["dst_ptr"] = signature["dst_ptr"], signature["src_ptr"]
    for name in constexprs:
        signature[name] = "constexpr"
    if kernel == "reduce_splits":  # launched with its own options, whatever project_t's config
        options = {"num_warps": 4, "num_stages": 1}
    else:
        options = _launch_options(config)
    return signature, constexprs, options


# The compile table (tests/test_compile_table.py): the padded ranks a bucket's kernels compile for (padded_rank of
# every matrix approximation rank 1..32, which the autotuner's keys and the heuristics are sized by) and the
# gradient dtypes.
TABLE_RANKS = (1, 2, 4, 8, 16, 32)
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _TableLayout:
    """What the heuristics read of a layout: its largest rank and whether it is the batched view."""

    def __init__(self, max_rank: int, batched: bool):
        self.max_rank, self.batched = max_rank, batched


def table_jobs(ranks=TABLE_RANKS, dtypes=TABLE_DTYPES, num_sms: int = 132) -> list:
    """Every distinct compile of the launches the hooks make: each kernel function x its :func:`variants` x
    ``dtypes`` x padded ``ranks``, with the GPU heuristic's config for that rank, dtype and view (the batched view for
    ``PADDED``/``PAD_ERROR`` variants: project_t takes another tile there; reduce_splits and orthogonalize_gram
    project_t's and orthogonalize's configs), one job per distinct (argument types, constexprs, launch options).
    Returns ``[(kernel, config, dtype, rank, variant)]`` for :func:`compile_aot` (``split`` dropped and
    ``WITH_GRAM=False``: the reducer and the Gram launch are jobs of their own). Needs ``TRITON_INTERPRET`` unset
    (the heuristic, not the interpreter's config)."""
    from powersgd_triton.layout import KERNELS
    from powersgd_triton.ops.configs import heuristic_config

    tuned_as = {"reduce_splits": "project_t", "orthogonalize_gram": "orthogonalize"}
    seen, jobs = set(), []
    for kernel in KERNEL_FUNCTIONS:
        tuned = tuned_as.get(kernel, kernel)
        for variant in variants(kernel):
            v = {k: x for k, x in variant.items() if k != "split"}
            if kernel == "orthogonalize":
                v["WITH_GRAM"] = False
            batched = bool(v.get("PADDED") or v.get("PAD_ERROR"))
            for dtype in dtypes:
                for r in ranks:
                    cfg = heuristic_config(tuned, _TableLayout(r, batched), dtype, num_sms) if tuned in KERNELS else {}
                    sig, const, opts = _compile_args(kernel, cfg, dtype, r, v)
                    key = (kernel, tuple(sorted(sig.items())), tuple(sorted((k, str(x)) for k, x in const.items())),
                           tuple(sorted(opts.items())))
                    if key not in seen:
                        seen.add(key)
                        jobs.append((kernel, cfg, dtype, r, v))
    return jobs


def compile_aot(kernel: str, config: dict, grad_dtype: torch.dtype, max_rank: int, arch: int, variant=None):
    """Compile ``kernel`` with ``config`` for ``sm_<arch>`` (e.g. 80, 90) without a GPU; returns the compiled kernel.

    ``variant`` sets the feature constexprs (``HAS_ERROR``, ``HAS_FLAG``, commit_factor's ``ROWS_COL``/``OFF_COL``);
    ``orthogonalize`` also compiles ``orthogonalize_gram`` (its first launch for split factors) unless
    ``WITH_GRAM=False``; ``project_t`` compiles the config its launcher would use for the variant
    (:func:`padding_error_config`). Must run with ``TRITON_INTERPRET`` unset (the interpreter replaces ``@triton.jit`` functions at import time). Raises
    ``RuntimeError`` under the interpreter and whatever Triton raises on a compile error.
    """
    from powersgd_triton.compat.versions import ast_source, gpu_target

    fn = KERNEL_FUNCTIONS[kernel]
    if not hasattr(fn, "arg_names") or _env.interpreter_enabled():
        raise RuntimeError("compile_aot needs TRITON_INTERPRET unset (kernels are interpreted functions here)")
    signature, constexprs, options = _compile_args(kernel, config, grad_dtype, max_rank, variant)
    if kernel == "project_t":  # what project_t() launches for this variant
        config = padding_error_config(config, (variant or {}).get("PAD_ERROR", False))
    src = ast_source(fn, signature, constexprs)
    compiled = triton.compile(src, target=gpu_target(arch), options=options)
    if kernel == "project_t" and variant is not None and variant.get("split"):  # the split path's reducer too
        compile_aot("reduce_splits", config, grad_dtype, max_rank, arch, dict(HAS_Q2=variant.get("HAS_Q2", False),
                                                                               wire=variant.get("wire", False)))
    if kernel == "orthogonalize" and (variant or {}).get("WITH_GRAM", True):  # and the Gram launch of split factors
        compile_aot("orthogonalize_gram", config, grad_dtype, max_rank, arch, variant)
    return compiled


def variants(kernel: str) -> Iterable[dict]:
    """The feature-flag combinations a kernel is launched with (all are compiled in the AOT test), largest first.

    ``project``: error feedback or not, the alternating hook's second P output, the batched view's padding error,
    the loss scale of unscaled error memory (``LOSS_SCALE``, ``PowerSGDState(grad_scaler=)``; also in
    ``reconstruct`` and, for the padding error, ``project_t``).
    ``project_t``: plain, with the reducer of split matrices (``split``), second Q output, the batched view
    (``PADDED``: M has fewer than n x m elements), its padding error (``PAD_ERROR``, implies ``PADDED``).
    ``reconstruct``: the standard hooks (error feedback and/or warm-start commit of Q, gated by the step flags), the
    alternating hook's P and Q steps (local error, commit of P or Q), the batched view's padding error.
    ``wire`` (not a constexpr: the argument types): P (project) or Q (project_t, reduce_splits, average) in the
    buffer it is all-reduced in, in the communication dtype (the layer-wise and batched hooks on the Triton backend
    when it is not float32: by default for fp16/bf16 buckets). Not orthogonalize: triton 3.6 cannot compile its
    float64 ``tl.dot`` of a 16-bit load (an LLVM assertion on sm_90), so it reads a float32 copy of P.
    """
    if kernel == "project":
        return [dict(HAS_ERROR=True, HAS_P2=True, LOSS_SCALE=True), dict(HAS_ERROR=True, HAS_P2=True),
                dict(HAS_ERROR=True), dict(HAS_ERROR=False),
                dict(HAS_ERROR=False, HAS_P2=True), dict(HAS_ERROR=True, PAD_ERROR=True),
                dict(HAS_ERROR=True, PAD_ERROR=True, LOSS_SCALE=True),
                dict(HAS_ERROR=True, wire=True), dict(HAS_ERROR=True, PAD_ERROR=True, LOSS_SCALE=True, wire=True)]
    if kernel == "reconstruct":
        return [
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=2, COMMIT=2, LOSS_SCALE=True),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=2, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True),
            dict(HAS_ERROR=True, HAS_FLAG=False),
            dict(HAS_ERROR=False, HAS_FLAG=False),
            dict(HAS_ERROR=False, HAS_FLAG=True, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=1, COMMIT=1),
            dict(HAS_ERROR=False, HAS_FLAG=True, COMMIT=1),
            dict(HAS_ERROR=True, HAS_FLAG=True, PAD_ERROR=True, COMMIT=2),
            dict(HAS_ERROR=True, HAS_FLAG=True, PAD_ERROR=True, COMMIT=2, LOSS_SCALE=True),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=1, COMMIT=1, LOSS_SCALE=True),
        ]
    if kernel == "commit_factor":
        return [factor_columns("p"), factor_columns("q")]
    if kernel == "project_t":
        return [dict(split=True, HAS_Q2=True), dict(split=True), dict(), dict(PADDED=True), dict(PAD_ERROR=True),
                dict(PAD_ERROR=True, LOSS_SCALE=True), dict(split=True, wire=True),
                dict(PAD_ERROR=True, LOSS_SCALE=True, wire=True)]
    if kernel == "copy_segments":
        return [dict(to_packed=True), dict(to_packed=False)]
    if kernel == "reduce_splits":
        return [dict(HAS_Q2=True), dict(), dict(wire=True)]
    if kernel == "average":
        return [dict(), dict(wire=True)]
    return [dict()]
