"""Ahead-of-time compilation of the bucket kernels for a GPU target on a machine without GPU.

:data:`KERNEL_FUNCTIONS` maps each launch's name to its ``@triton.jit`` function; :func:`compile_aot` compiles
one with a config and feature variant exactly as its launcher would launch it, with the argument attributes
Triton's JIT specializes a GPU launch on (:func:`jit_attributes`: 16-byte aligned pointers, integers divisible by
16 or equal to 1); :func:`variants` lists the
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
from powersgd_triton.ops.segments import AVERAGE_BLOCK, AVERAGE_ITERS, CHUNK_ALIGN, SEGMENT_BLOCK, SEGMENT_ITERS, SEGMENT_WARPS, _average_kernel, _commit_factor_kernel, _copy_segments_kernel



_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _signature(kernel: str, grad_dtype: torch.dtype, wire: bool = False, variant=None) -> Dict[str, str]:
    """The argument types of a kernel launch on a bucket of ``grad_dtype``; ``wire``: the factor the launch writes
    (project: P, project_t and reduce_splits: Q) or reads (average: Q) is the buffer it is all-reduced in, in the
    communication dtype (here the bucket's: the hooks' default on the Triton backend); copy_segments: the packed
    buffer is in the bucket's dtype (the hooks') instead of float32. An optional tensor the launch goes without is
    passed as the tensor the launcher puts in its place (project: P; reconstruct: P), of that tensor's type, as
    the JIT sees it (``variant``'s feature flags say which are absent)."""
    g = "*" + _TRITON_DTYPES[grad_dtype]
    f, i64, i32 = "*fp32", "*i64", "*i32"
    w = g if wire else f
    v = variant or {}
    if kernel == "project":
        err = v.get("HAS_ERROR", True)
        pack = v.get("PACK", False)  # the pack programs' chunk table and packed buffer (else: tiles and P in place)
        return dict(buf_ptr=g, q_ptr=f, p_ptr=w, p2_ptr=w, e_ptr=f if err else w, table_ptr=i64, tiles_ptr=i32,
                    ls_ptr=f if v.get("LOSS_SCALE", False) else w, chunks_ptr=i64 if pack else i32,
                    packed_ptr=g if pack else w)
    if kernel == "project_t":
        return dict(buf_ptr=g, p_ptr=f, q_ptr=w, q2_ptr=w, e_ptr=f, ws_ptr=f, table_ptr=i64, tiles_ptr=i32, ls_ptr=f)
    if kernel == "reduce_splits":
        return dict(ws_ptr=f, q_ptr=w, q2_ptr=w, table_ptr=i64, reduce_tiles_ptr=i32)
    if kernel == "copy_segments":
        return dict(src_ptr=g, dst_ptr=w, tiles_ptr=i64, scale="fp32")
    if kernel == "average":
        return dict(f_ptr=w, fo_ptr=f, src_ptr=g, dst_ptr=g, flags_ptr="*u8", tiles_ptr=i64, world="fp32")
    if kernel == "commit_factor":
        return dict(new_ptr=f, kept_ptr=f, flag_ptr="*u8", table_ptr=i64)
    if kernel == "orthogonalize":
        return dict(x_ptr=f, out_ptr=f, ws_ptr="*fp64", tasks_ptr=i64, eps="fp32")
    if kernel == "orthogonalize_gram":
        return dict(x_ptr=f, ws_ptr="*fp64", tasks_ptr=i64)
    return dict(
        buf_ptr=g, p_ptr=f, q_ptr=f, lf_ptr=f, e_ptr=f, kept_ptr=f, flags_ptr="*u8" if v.get("HAS_FLAG", True) else f,
        first_ptr=i32, table_ptr=i64, tiles_ptr=i32, ls_ptr=f, n_flags="i32", scale="fp32",
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
        return {"BLOCK": SEGMENT_BLOCK, "ITERS": SEGMENT_ITERS, "ALIGN": variant.get("ALIGN", 0)}
    if kernel == "average":
        return {"BLOCK": AVERAGE_BLOCK, "ITERS": AVERAGE_ITERS, "ALIGN": variant.get("ALIGN", 0),
                "RECIP": variant.get("RECIP", False)}
    if kernel == "commit_factor":
        return {"BLOCK": 256, "ROWS_COL": variant.get("ROWS_COL", COLS), "OFF_COL": variant.get("OFF_COL", Q_OFF)}
    c.update({k: config[k] for k in (_tile_key(kernel), "BLOCK_K", "USE_DOT")})
    c["PREFETCH"] = config.get("PREFETCH", 0)
    c["PAD_ERROR"] = variant.get("PAD_ERROR", False)
    c["LOSS_SCALE"] = variant.get("LOSS_SCALE", False)
    c["ALIGN"] = variant.get("ALIGN", 0)  # the aligned layout's vector width (ops.aligned.vector_width)
    if kernel == "project":
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
        c["HAS_P2"] = variant.get("HAS_P2", False)
        # the pack programs (PACK: one chunk per warp; PACK_ALIGN: the chunks' alignment, chunk_alignment)
        c["PACK"] = _launch_options(config)["num_warps"] if variant.get("PACK") else 0
        c["PACK_ALIGN"] = variant.get("PACK_ALIGN", 0) if variant.get("PACK") else 0
    if kernel == "project_t":
        c["HAS_Q2"] = variant.get("HAS_Q2", False)
        c["PADDED"] = variant.get("PADDED", c["PAD_ERROR"])
        c["SPLIT_BF16"] = bool(config.get("SPLIT_BF16", False))
        c["RANK"] = padded_rank(max_rank) if c["ALIGN"] else 0
    if kernel in ("project", "reconstruct"):
        c["CARRY"] = bool(config.get("CARRY", False))
    if kernel == "reconstruct":
        c["HAS_ERROR"] = variant.get("HAS_ERROR", True)
        c["HAS_FLAG"] = variant.get("HAS_FLAG", True)
        c["LOCAL_ERR"] = variant.get("LOCAL_ERR", 0)
        c["COMMIT"] = variant.get("COMMIT", 0)
    return c


# The launch options the launchers of the helper kernels pass (ops/segments.py: num_warps only, so Triton's default
# num_stages applies), compiled alike: the JIT's binary of the launch (tests/test_aot_jit_match.py).
HELPER_OPTIONS = {"copy_segments": {"num_warps": SEGMENT_WARPS}, "average": {"num_warps": 4}, "commit_factor": {"num_warps": 4}}


def _align_value(kernel: str, config: dict, grad_dtype: torch.dtype, variant: dict) -> dict:
    """``variant`` with ``ALIGN=True`` (the aligned layout, :mod:`powersgd_triton.ops.aligned`) replaced by the
    constexpr its launcher passes for ``config`` and ``grad_dtype``: the 16-byte vector width where the path takes it
    (project / reconstruct: the broadcast path; project_t: the broadcast path and the split tensor-core path of 2-byte
    gradients; average / copy_segments: the chunks' alignment), else 0."""
    if variant.get("ALIGN") is not True:
        return variant
    es = torch.empty((), dtype=grad_dtype).element_size()
    if kernel == "project" and variant.get("PACK") and "PACK_ALIGN" not in variant:  # the chunks: aligned too
        variant = dict(variant, PACK_ALIGN=CHUNK_ALIGN)
    if kernel in ("average", "copy_segments"):
        width = CHUNK_ALIGN
    else:
        split_dot = kernel == "project_t" and config.get("SPLIT_BF16") and es == 2
        width = 0 if config.get("USE_DOT") and not split_dot else 16 // es
    return dict(variant, ALIGN=width)


def _compile_args(kernel: str, config: dict, grad_dtype: torch.dtype, max_rank: int, variant=None):
    """(argument types with the constexprs marked, constexprs, launch options) of a launch: what one compile is."""
    if kernel == "project_t":  # what project_t() launches for this variant
        config = padding_error_config(config, (variant or {}).get("PAD_ERROR", False))
    variant = _align_value(kernel, config, grad_dtype, variant or {})
    constexprs = _constexprs(kernel, config, max_rank, variant or {})
    signature = dict(_signature(kernel, grad_dtype, bool((variant or {}).get("wire", False)), variant))
    if kernel == "copy_segments" and not (variant or {}).get("to_packed", True):
        signature["src_ptr"], signature["dst_ptr"] = signature["dst_ptr"], signature["src_ptr"]
    for name in constexprs:
        signature[name] = "constexpr"
    if kernel == "reduce_splits":  # launched with its own options, whatever project_t's config
        options = {"num_warps": 4, "num_stages": 1}
    elif kernel in HELPER_OPTIONS:
        options = dict(HELPER_OPTIONS[kernel])
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

    def __init__(self, max_rank: int, batched: bool, aligned: bool = False):
        self.max_rank, self.batched, self.aligned = max_rank, batched, aligned


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
                    table = _TableLayout(r, batched, bool(v.get("ALIGN")))
                    cfg = heuristic_config(tuned, table, dtype, num_sms) if tuned in KERNELS else {}
                    sig, const, opts = _compile_args(kernel, cfg, dtype, r, v)
                    key = (kernel, tuple(sorted(sig.items())), tuple(sorted((k, str(x)) for k, x in const.items())),
                           tuple(sorted(opts.items())))
                    if key not in seen:
                        seen.add(key)
                        jobs.append((kernel, cfg, dtype, r, v))
    return jobs


# Torch dtypes of the pointer types of _signature: a stand-in tensor of each is what jit_attributes specializes.
_POINTEE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
            "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8}


def launch_ints(kernel: str, variant=None) -> Dict[str, int]:
    """The integer runtime arguments of a launch as :func:`compile_aot` compiles them by default: reconstruct's
    ``n_flags`` (the step flags' count, one per program of the average launch: 0 without ``HAS_FLAG``, which the JIT
    marks divisible by 16 like any multiple of 16; else 3, a count that is neither 1 nor a multiple of 16, the
    general case: a layout whose average runs exactly one program, or a multiple of 16 programs, compiles another
    binary, as the JIT would -- pass the layout's own count in ``ints``). The only integer runtime argument of our
    kernels; the others are pointers and floats."""
    if kernel == "reconstruct":
        return {"n_flags": 3 if (variant or {}).get("HAS_FLAG", True) else 0}
    return {}


def jit_attributes(kernel: str, signature: Dict[str, str], arch: int, aligned=True, ints=None):
    """What Triton's JIT specializes in a launch of ``kernel`` on a GPU, for an ahead-of-time compile of the same
    binary: ``(signature, constexprs, attrs)`` -- the signature with an integer argument of value 1 turned into a
    constexpr, those constexprs, and the attributes per argument index (``tt.divisibility = 16`` on a pointer whose
    tensor is 16-byte aligned and on an integer that is a multiple of 16).

    ``aligned``: True (every pointer argument's tensor 16-byte aligned: what the hooks launch, every buffer being an
    allocation of its own -- the bucket, the factors, the error memory, the tables), False (none), or the names of
    the aligned ones. ``ints``: name -> value of integer arguments (default :func:`launch_ints`). Each value goes
    through Triton's own specialization (:func:`powersgd_triton.compat.versions.jit_specialization`) on a stand-in:
    a CPU tensor of the pointee dtype (aligned, or one element past an aligned start), or the integer."""
    from powersgd_triton.compat.versions import gpu_target, jit_specialization

    fn = KERNEL_FUNCTIONS[kernel]
    target = gpu_target(arch)
    ints = dict(ints or {})
    names = list(fn.arg_names)
    out_sig, constexprs, attrs = dict(signature), {}, {}
    for name, ty in signature.items():
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            is_aligned = aligned if isinstance(aligned, bool) else name in aligned
            base = torch.empty(8, dtype=_POINTEE[ty[1:]])
            value = base if is_aligned else base[1:]
        elif ty[0] in "iu" and ty != "u1":
            if name not in ints:
                raise KeyError(f"{kernel}: no value for the integer argument {name} (ints=)")
            value = int(ints[name])
        else:  # floats and bools: never specialized
            continue
        jit_ty, key, attr = jit_specialization(value, target)
        if jit_ty == "constexpr":
            out_sig[name], constexprs[name] = "constexpr", value
        elif key is not None:
            attrs[(names.index(name),)] = attr
    return out_sig, constexprs, attrs


def compile_aot(kernel: str, config: dict, grad_dtype: torch.dtype, max_rank: int, arch: int, variant=None, *,
                aligned=True, ints=None, jit=True):
    """Compile ``kernel`` with ``config`` for ``sm_<arch>`` (e.g. 80, 90) without a GPU, as Triton's JIT compiles the
    launch on that GPU; returns the compiled kernel.

    ``variant`` sets the feature constexprs (``HAS_ERROR``, ``HAS_FLAG``, commit_factor's ``ROWS_COL``/``OFF_COL``);
    ``orthogonalize`` also compiles ``orthogonalize_gram`` (its first launch for split factors) unless
    ``WITH_GRAM=False``; ``project_t`` compiles the config its launcher would use for the variant
    (:func:`padding_error_config`). ``aligned`` and ``ints``: the launch's pointer alignment and integer arguments
    as :func:`jit_attributes` takes them (default: every pointer 16-byte aligned, what the hooks launch, and
    :func:`launch_ints`); the JIT's specialization of them (pointer divisibility, integers divisible by 16 or equal
    to 1) is compiled in. ``jit=False``: no specialization at all (every pointer and integer unknown: the compile
    before issue 39, for comparisons). Must run with ``TRITON_INTERPRET`` unset (the interpreter replaces
    ``@triton.jit`` functions at import time). Raises ``RuntimeError`` under the interpreter and whatever Triton
    raises on a compile error.
    """
    from powersgd_triton.compat.versions import ast_source, gpu_target

    fn = KERNEL_FUNCTIONS[kernel]
    if not hasattr(fn, "arg_names") or _env.interpreter_enabled():
        raise RuntimeError("compile_aot needs TRITON_INTERPRET unset (kernels are interpreted functions here)")
    signature, constexprs, options = _compile_args(kernel, config, grad_dtype, max_rank, variant)
    attrs = None
    if jit:
        values = launch_ints(kernel, variant)
        values.update(ints or {})
        signature, ints_const, attrs = jit_attributes(kernel, signature, arch, aligned, values)
        constexprs = dict(constexprs, **ints_const)
    if kernel == "project_t":  # what project_t() launches for this variant
        config = padding_error_config(config, (variant or {}).get("PAD_ERROR", False))
    src = ast_source(fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=gpu_target(arch), options=options)
    more = dict(aligned=aligned, jit=jit)
    if kernel == "project_t" and variant is not None and variant.get("split"):  # the split path's reducer too
        compile_aot("reduce_splits", config, grad_dtype, max_rank, arch, dict(HAS_Q2=variant.get("HAS_Q2", False),
                                                                               wire=variant.get("wire", False)), **more)
    if kernel == "orthogonalize" and (variant or {}).get("WITH_GRAM", True):  # and the Gram launch of split factors
        compile_aot("orthogonalize_gram", config, grad_dtype, max_rank, arch, variant, **more)
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
    when it is not float32: by default for fp16/bf16 buckets); copy_segments: the packed uncompressed gradients in
    that dtype too (else float32). Not orthogonalize: triton 3.6 cannot compile its
    float64 ``tl.dot`` of a 16-bit load (an LLVM assertion on sm_90), so it reads a float32 copy of P.
    ``PACK`` (project): the layer-wise hook's launch that packs the uncompressed gradients too, error feedback or
    not, P in the communication dtype or not; ``PACK_ALIGN`` the chunks' alignment (with ``ALIGN``: aligned unless
    it says 0; without: ragged unless it says ``CHUNK_ALIGN``; the matrices and the chunks of one bucket may differ:
    a ragged bias at the end of an aligned bucket).
    ``ALIGN`` (``True``: the aligned layout of :mod:`powersgd_triton.ops.aligned`, 16-byte accesses; resolved per
    dtype and config by :func:`_compile_args`): the streaming kernels' hooks variants and the elementwise launches
    again on a bucket whose matrices and chunks start at and span multiples of 16 bytes (the table compiles both
    layouts of every kernel, with the aligned layout's heuristic tiles).
    """
    if kernel == "project":
        return [dict(HAS_ERROR=True, HAS_P2=True, LOSS_SCALE=True), dict(HAS_ERROR=True, HAS_P2=True),
                dict(HAS_ERROR=True), dict(HAS_ERROR=False),
                dict(HAS_ERROR=False, HAS_P2=True), dict(HAS_ERROR=True, PAD_ERROR=True),
                dict(HAS_ERROR=True, PAD_ERROR=True, LOSS_SCALE=True),
                dict(HAS_ERROR=True, wire=True), dict(HAS_ERROR=True, PAD_ERROR=True, wire=True),
                dict(HAS_ERROR=True, PAD_ERROR=True, LOSS_SCALE=True, wire=True),
                dict(HAS_ERROR=True, HAS_P2=True, LOSS_SCALE=True, ALIGN=True), dict(HAS_ERROR=True, ALIGN=True),
                dict(HAS_ERROR=False, HAS_P2=True, ALIGN=True), dict(HAS_ERROR=True, wire=True, ALIGN=True),
                dict(HAS_ERROR=True, PACK=True), dict(HAS_ERROR=False, PACK=True),
                dict(HAS_ERROR=True, wire=True, PACK=True), dict(HAS_ERROR=True, PACK=True, PACK_ALIGN=CHUNK_ALIGN),
                dict(HAS_ERROR=True, wire=True, PACK=True, PACK_ALIGN=CHUNK_ALIGN),
                dict(HAS_ERROR=True, PACK=True, ALIGN=True), dict(HAS_ERROR=False, PACK=True, ALIGN=True),
                dict(HAS_ERROR=True, wire=True, PACK=True, ALIGN=True),
                dict(HAS_ERROR=True, PACK=True, ALIGN=True, PACK_ALIGN=0),
                dict(HAS_ERROR=True, wire=True, PACK=True, ALIGN=True, PACK_ALIGN=0)]
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
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=2, COMMIT=2, LOSS_SCALE=True, ALIGN=True),
            dict(HAS_ERROR=True, HAS_FLAG=True, COMMIT=2, ALIGN=True),
            dict(HAS_ERROR=True, HAS_FLAG=True, LOCAL_ERR=1, COMMIT=1, LOSS_SCALE=True, ALIGN=True),
            dict(HAS_ERROR=False, HAS_FLAG=True, COMMIT=1, ALIGN=True),
        ]
    if kernel == "commit_factor":
        return [factor_columns("p"), factor_columns("q")]
    if kernel == "project_t":
        return [dict(split=True, HAS_Q2=True), dict(split=True), dict(), dict(PADDED=True), dict(PAD_ERROR=True),
                dict(PAD_ERROR=True, LOSS_SCALE=True), dict(split=True, wire=True), dict(PAD_ERROR=True, wire=True),
                dict(PAD_ERROR=True, LOSS_SCALE=True, wire=True), dict(split=True, HAS_Q2=True, ALIGN=True),
                dict(split=True, ALIGN=True), dict(split=True, wire=True, ALIGN=True)]
    if kernel == "copy_segments":
        return [dict(to_packed=True), dict(to_packed=False), dict(to_packed=True, wire=True),
                dict(to_packed=False, wire=True), dict(to_packed=True, ALIGN=True), dict(to_packed=False, ALIGN=True),
                dict(to_packed=True, wire=True, ALIGN=True)]
    if kernel == "reduce_splits":
        return [dict(HAS_Q2=True), dict(), dict(wire=True)]
    if kernel == "average":
        return [dict(), dict(wire=True), dict(RECIP=True), dict(wire=True, RECIP=True), dict(ALIGN=True),
                dict(ALIGN=True, RECIP=True),
                dict(wire=True, ALIGN=True, RECIP=True)]
    return [dict()]
