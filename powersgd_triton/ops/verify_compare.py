"""The comparison rule of the first-use check (:mod:`powersgd_triton.ops.verify`): what is compared, against what scale,
with what tolerance. Stated for users in ``docs/guides/verification.md``.

Every numeric launch of a checked step runs twice: the Triton launch on the live tensors and the torch backend on
copies of the very same inputs (:class:`Differential`). The outputs are then compared in quantities both backends
must agree on whatever valid choice each made:

* Products (``project``'s P, ``project_t``'s Q, ``reconstruct``'s output ``P·Qᵀ`` and error memory
  ``M + s·E - P·Qᵀ``, ``average``, the copies): element by element, per matrix. The error of a slice is
  ``max |triton - torch|``; its scale is the largest magnitude the slice was computed from, not only the largest
  ``|torch|`` of the result: for the error memory and the output ``max|M + s·E|`` and ``r·max|P|·max|Q|`` before the
  launch, for P ``max|M + s·E|·max|Q|``, for Q ``max|M + s·E|·max|P|``. A result that cancels (rank-deficient
  gradients: the error memory is rounding noise around 0) is then judged against the numbers it came from, as
  float32 rounding is.
* ``orthogonalize``: never element by element. Gram-Schmidt of a rank-deficient factor completes it with a basis of
  a degenerate subspace, and two correct kernels may pick different ones. Compared per matrix: the Gram matrix
  ``OᵀO`` (scale 1) and the projection of the input onto the output's span ``O·(Oᵀ·X)`` (scale ``max|X|``), both
  invariant under that choice and both wrong when the kernel is. Each Gram entry is weighed by the conditioning of
  its two columns (the smaller ``rho_k = |R_kk| / |x_k|``, the share of column k not explained by the columns before
  it): float32 Gram-Schmidt loses orthogonality by about ``2^-24 / rho``, so a nearly dependent column's
  orthogonality is rounding, not a verdict.
* Ranges another collective may still be writing are not compared: while ``project``, ``orthogonalize`` and
  ``project_t`` run, the all-reduce of the uncompressed gradients (issued first, asynchronous) may be writing the
  bucket's uncompressed ranges (:data:`IN_FLIGHT`); those launches neither read nor write them.

Tolerance (:func:`tolerance`): the worst error over scale of a tensor may be ``1e-3`` for fp32 buckets (float32
summation-order differences are a few ulps of the scale, below ``1e-5`` measured), ``1e-2`` for the float32 outputs
of fp16/bf16 buckets and ``2e-2`` / ``4e-2`` for their outputs stored in fp16 / bf16 (the rounding of 2-byte
operands); plus one rounding step of the compared tensor's own storage dtype when it is 16-bit
(:func:`storage_step`: ``2^-7`` bf16, ``2^-10`` fp16, relative), since two results a few float32 ulps apart may
round to neighbouring 16-bit values: P and Q written in a bf16/fp16 communication dtype on fp32 buckets. A wrong
kernel (a race, a wrong mask, a miscompiled loop, a launch that did not run) is off by O(1) of the scale where it
is wrong. A torch result holding NaN or inf cannot be judged; a NaN or inf where the torch result is finite is wrong.
"""

import inspect
import logging
import math
from typing import Dict, List, Optional, Tuple

import torch

from powersgd_triton import ops

logger = logging.getLogger("powersgd_triton.verify")

# The ops a hook step launches, and the kernel each one's verdict is kept under.
KERNEL_OF = {"project": "project", "orthogonalize": "orthogonalize", "project_t": "project_t",
             "reconstruct": "reconstruct", "average": "average", "pack_uncompressed": "copy_segments",
             "unpack_uncompressed": "copy_segments", "commit_factor": "commit_factor"}
OK, DEFERRED, WRONG = 0, 1, 2
# Launches the hooks make while the asynchronous all-reduce of the uncompressed gradients may still be writing the
# bucket's uncompressed ranges (before they wait for it): those ranges are not compared.
IN_FLIGHT = ("project", "orthogonalize", "project_t")

_ROLES = {"buffer": "m", "p": "p", "q": "q", "error": "e", "p2": "p", "q2": "q", "local_p": "p", "local_q": "q",
          "unc": "u", "dst": "u", "src": "u", "packed": "u", "loss_scale": "u", "new": None, "kept": None, "x": None, "out": None,
          "factor": None, "orthogonalize_kept": "q"}
# Arguments whose content after the call the ops do not specify (scratch): not compared. ``average`` divides the
# packed uncompressed gradients on their way into the bucket (the torch backend in place, the Triton kernel not).
_UNSPECIFIED = {"average": ("unc",)}
_SIGNATURES = {name: inspect.signature(getattr(ops, name)) for name in KERNEL_OF}
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def storage_step(dtype: torch.dtype) -> float:
    """Largest relative distance of two neighbouring values of ``dtype`` (one rounding step: ``2^-7`` bf16,
    ``2^-10`` fp16); 0 for 4- and 8-byte dtypes, whose steps are far below the tolerances."""
    return {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 0.0)


def tolerance(role: str, bucket_dtype: torch.dtype, out_dtype: Optional[torch.dtype] = None) -> float:
    """Largest worst relative error accepted for an output of ``role`` (``"m"``/``"u"``: stored in the bucket's
    dtype; ``"p"``/``"q"``/``"e"``: float32 or the communication dtype) of a bucket of ``bucket_dtype``, stored in
    ``out_dtype`` (module docstring: why)."""
    if bucket_dtype not in _SIXTEEN_BIT:
        base = 1e-3
    elif role in ("m", "u"):
        base = 2e-2 if bucket_dtype == torch.float16 else 4e-2
    else:
        base = 1e-2
    return base + storage_step(out_dtype if out_dtype is not None else torch.float32)


def _segments(layout, role: str, numel: int) -> List[Tuple[int, int]]:
    """``(offset, length)`` slices of a tensor of ``role``: one per matrix (in the layout's order), then for the
    bucket (``"m"``) its uncompressed ranges; other tensors as one slice."""
    mats = layout.matrices
    if role == "p":
        return [(s.p_offset, s.n * s.rank) for s in mats]
    if role == "q":
        return [(s.q_offset, s.m * s.rank) for s in mats]
    if role == "e":
        return [(s.e_offset, s.n * s.m if layout.batched else s.numel) for s in mats]
    if role == "m":
        return [(s.offset, s.numel) for s in mats] + list(layout.uncompressed)
    return [(0, numel)]


def seg_amax(t: Optional[torch.Tensor], segs) -> List[float]:
    """``max |t|`` over each slice (0 for an empty slice or no tensor; non-finite maxima count as 0: they make the
    compared result non-finite, judged so), with one host read."""
    if t is None:
        return [0.0] * len(segs)
    flat = t.detach().reshape(-1)
    vals = [flat[o : o + n].abs().max().double() if n else flat.new_zeros((), dtype=torch.float64) for o, n in segs]
    if not vals:
        return []
    return torch.nan_to_num(torch.stack(vals), nan=0.0, posinf=0.0).cpu().tolist()


def compare(got: torch.Tensor, want: torch.Tensor, layout, role: str, floors: Optional[List[float]] = None,
            skip_uncompressed: bool = False) -> Tuple[float, bool]:
    """``(worst relative error, judgeable)`` of ``got`` (Triton) against ``want`` (torch), per slice of ``role``
    (:func:`_segments`): ``max |got - want|`` over ``max(max |want|, floor)`` of the slice (``floors[i]``: the
    i-th slice's input scale, see the module docstring). ``skip_uncompressed``: the bucket's uncompressed ranges
    are not compared. Not judgeable: ``want`` holds NaN or inf in a compared slice; then nothing is concluded."""
    a, b = got.detach().reshape(-1), want.detach().reshape(-1)
    segs = _segments(layout, role, a.numel())
    if skip_uncompressed and role == "m":
        segs = segs[: len(layout.matrices)]
    whole = len(segs) == 1 and segs[0] == (0, a.numel())
    if whole and torch.equal(a, b):
        return 0.0, True
    worst = 0.0
    for i, (off, n) in enumerate(segs):
        if n == 0:
            continue
        x, y = a[off : off + n].double(), b[off : off + n].double()
        if not bool(torch.isfinite(y).all()):
            return math.nan, False
        if torch.equal(x, y):
            continue
        if not bool(torch.isfinite(x).all()):  # NaN or inf where torch is finite
            worst = math.inf
            continue
        scale = max(float(y.abs().max()), floors[i] if floors is not None and i < len(floors) else 0.0)
        d = float((x - y).abs().max())
        worst = max(worst, d / scale if scale > 0 else math.inf)
    return worst, True


def compare_orthogonal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, layout, which: str) -> Tuple[float, bool]:
    """``(worst relative error, judgeable)`` of ``orthogonalize``'s output ``got`` (Triton) against ``want`` (torch)
    of the input ``x`` (as before the launch), per matrix, in quantities that do not depend on the basis Gram-Schmidt
    completes a rank-deficient factor with: ``OᵀO`` (scale 1, each entry weighed by the conditioning of its two
    columns: ``rho_k = |R_kk| / |x_k|``, the share of column k not explained by the columns before it, the smaller
    of the two; float32 Gram-Schmidt loses orthogonality by about ``u / rho``) and ``O·(Oᵀ·X)`` (scale
    ``max |X|``)."""
    a, b, xs = got.detach().reshape(-1), want.detach().reshape(-1), x.detach().reshape(-1)
    if torch.equal(a, b):
        return 0.0, True
    worst = 0.0
    for s in layout.matrices:
        rows = s.n if which == "p" else s.m
        off = s.p_offset if which == "p" else s.q_offset
        n = rows * s.rank
        if n == 0:
            continue
        o_t = a[off : off + n].double().view(rows, s.rank)
        o_r = b[off : off + n].double().view(rows, s.rank)
        xi = xs[off : off + n].double().view(rows, s.rank)
        if not (bool(torch.isfinite(o_r).all()) and bool(torch.isfinite(xi).all())):
            return math.nan, False
        if torch.equal(o_t, o_r):
            continue
        if not bool(torch.isfinite(o_t).all()):
            worst = math.inf
            continue
        # rho_k: the share of column k not explained by the columns before it (|R_kk| / |x_k|, from the torch
        # result); Gram-Schmidt in float32 loses orthogonality by about u / rho, so each Gram entry is weighed by
        # the smaller rho of its two columns (0 for a dependent or zero column: its completion is free)
        norms = xi.norm(dim=0)
        rho = torch.where(norms > 0, (o_r * xi).sum(0).abs() / norms.clamp_min(1e-300), torch.zeros_like(norms))
        rho = rho.clamp(max=1.0)
        weight = torch.minimum(rho[:, None], rho[None, :])
        gram = float(((o_t.T @ o_t - o_r.T @ o_r).abs() * weight).max())
        xmax = float(xi.abs().max())
        proj = float((o_t @ (o_t.T @ xi) - o_r @ (o_r.T @ xi)).abs().max()) / xmax if xmax > 0 else 0.0
        worst = max(worst, gram, proj)
    return worst, True


def _floors(name: str, args: dict, layout) -> Dict[str, List[float]]:
    """Per role, per matrix: the input scale of the launch ``name``'s outputs (module docstring), from its
    arguments as they are before the launch."""
    mats = layout.matrices
    if name not in ("project", "project_t", "reconstruct") or not mats:
        return {}
    ls = args.get("loss_scale")
    s = float(ls.reshape(-1)[0]) if isinstance(ls, torch.Tensor) else 1.0
    s = s if math.isfinite(s) and s > 0 else 1.0
    m_max = seg_amax(args.get("buffer"), _segments(layout, "m", 0)[: len(mats)])
    e_max = seg_amax(args.get("error"), _segments(layout, "e", 0))
    a = [mi + s * ei for mi, ei in zip(m_max, e_max)]  # max |M + s·E| (bound)
    p_max = seg_amax(args.get("p"), _segments(layout, "p", 0))
    q_max = seg_amax(args.get("q"), _segments(layout, "q", 0))
    if name == "project":
        return {"p": [ai * qi for ai, qi in zip(a, q_max)], "m": a, "e": [ai / s for ai in a]}
    if name == "project_t":
        return {"q": [ai * pi for ai, pi in zip(a, p_max)], "m": a, "e": [ai / s for ai in a]}
    scale = abs(float(args.get("scale", 1.0)))
    out = [max(ai, sp.rank * pi * qi * scale) for ai, sp, pi, qi in zip(a, mats, p_max, q_max)]
    return {"m": out, "e": [o / s for o in out], "p": p_max, "q": q_max}


class Differential:
    """Runs :mod:`powersgd_triton.ops` calls on the Triton backend (the given tensors) and on the torch backend
    (copies made before the Triton call) and keeps per kernel ``[worst error / tolerance, judgeable, detail, config,
    worst error]`` (the module docstring says what is compared). The :class:`~powersgd_triton.ops.StepFlags` of a
    Triton ``average`` stand for its torch twin in later calls."""

    def __init__(self, layout, bucket_dtype: torch.dtype, configs: Optional[Dict[str, Optional[dict]]] = None):
        self.layout, self.dtype = layout, bucket_dtype
        # a bucket memory's kernel configs: the calls are a hook's (``mem.steps``' signatures, without backend and
        # config), run on the Triton backend with the bucket's config; None: the calls name them (the tuner's gate)
        self.configs = configs
        self.results: Dict[str, list] = {}
        self.twins: Dict[int, object] = {}

    def __getattr__(self, name):
        if name not in KERNEL_OF:
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def call(self, name: str, *args, **kwargs):
        if self.configs is not None:
            kwargs["backend"] = "triton"
            if "config" in _SIGNATURES[name].parameters:
                kwargs["config"] = self.configs.get(KERNEL_OF[name])
        bound = _SIGNATURES[name].bind(*args, **kwargs)
        which = bound.arguments.get("which")
        copies: Dict[int, tuple] = {}  # id -> (argument name, live tensor, copy, role)

        def twin(arg, value, role):
            if isinstance(value, torch.Tensor):
                if id(value) not in copies:
                    copies[id(value)] = (arg, value, value.clone(), role or which)
                return copies[id(value)][2]
            if isinstance(value, ops.StepFlags):
                return self.twins.get(id(value), value)
            if isinstance(value, tuple):  # commit=(which, kept)
                return tuple(twin(arg, v, value[0]) for v in value)
            return value

        torch_args = {k: twin(k, v, _ROLES.get(k)) for k, v in bound.arguments.items()}
        torch_args["backend"] = "torch"
        torch_args.pop("config", None)
        if name == "reconstruct":
            torch_args["orthogonalize_kept"] = None  # the Triton backend never fills it: nothing to compare
        ortho_out = ortho_in = None
        if name == "orthogonalize":
            ortho_out = bound.arguments.get("out")
            ortho_out = bound.arguments["x"] if ortho_out is None else ortho_out
            ortho_in = copies[id(bound.arguments["x"])][2].clone()  # the torch twin may overwrite its copy
        floors = _floors(name, bound.arguments, self.layout)
        config = bound.arguments.get("config")
        result = getattr(ops, name)(*args, **kwargs)
        try:
            torch_result = getattr(ops, name)(**torch_args)
        except Exception as exc:  # noqa: BLE001 - our reference failing must not stop training: not judged
            logger.warning("powersgd_triton verify: the torch reference of %s failed (%s: %s); not judged",
                           name, type(exc).__name__, exc)
            self._record(name, (0.0, 0.0, ""), False, config)
            return result
        if isinstance(result, ops.StepFlags):
            self.twins[id(result)] = torch_result
        worst = (0.0, 0.0, "")  # error / tolerance, error, detail
        judged = True
        for arg, live, copy, role in copies.values():
            if arg in _UNSPECIFIED.get(name, ()):
                continue
            if live is ortho_out:
                err, ok = compare_orthogonal(live, copy, ortho_in, self.layout, which)
                what = "span and Gram matrix"
            else:
                err, ok = compare(live, copy, self.layout, role, floors.get(role), skip_uncompressed=name in IN_FLIGHT)
                what = "worst relative error"
            judged &= ok
            tol = tolerance(role, self.dtype, live.dtype)
            if ok and err / tol > worst[0]:
                worst = (err / tol, err, f"{arg}: {what} {err:.3g} (tolerance {tol:.3g})")
        self._record(name, worst, judged, config)
        return result

    def _record(self, name, worst, judged, config):
        """``results[kernel] = [error / tolerance, judgeable, detail, config, error]``, the worst call's."""
        r = self.results.setdefault(KERNEL_OF[name], [0.0, True, "", config, 0.0])
        if not judged:
            r[1] = False
        elif worst[0] > r[0]:
            r[0], r[4], r[2] = worst

    def codes(self) -> Dict[str, int]:
        """Per kernel seen: :data:`OK`, :data:`DEFERRED` (not judgeable) or :data:`WRONG` (beyond tolerance)."""
        return {k: WRONG if r[0] > 1.0 else (OK if r[1] else DEFERRED) for k, r in self.results.items()}
