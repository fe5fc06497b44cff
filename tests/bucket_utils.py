"""Helpers for kernel tests: buckets of gradients in a flat buffer, canary guards, float64 oracle."""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from powersgd_triton.layout import BucketLayout
from powersgd_triton.shapes import numel

GUARD = 37  # canary elements on each side of every buffer
CANARY = 3072.0  # exactly representable in float16 and bfloat16


def guarded(n: int, dtype=torch.float32, fill=float("nan")) -> Tuple[torch.Tensor, torch.Tensor]:
    """A flat tensor of ``n`` elements inside a larger one filled with ``fill``: returns (view, whole)."""
    whole = torch.full((n + 2 * GUARD,), fill, dtype=dtype)
    return whole[GUARD : GUARD + n], whole


def guards_intact(whole: torch.Tensor, n: int, fill=float("nan")) -> bool:
    g = torch.cat([whole[:GUARD], whole[GUARD + n :]]).float()
    if fill != fill:  # NaN
        return bool(torch.isnan(g).all())
    return bool((g == fill).all())


def make_bucket(shapes: Sequence[Tuple[int, ...]], dtype, gen: torch.Generator, scale: float = 1.0):
    """Random gradients of ``shapes`` back to back in one flat guarded buffer: (buffer, whole, grads)."""
    total = sum(numel(s) for s in shapes)
    buf, whole = guarded(total, dtype, fill=CANARY)
    buf.copy_((torch.randn(total, generator=gen) * scale).to(dtype))
    grads: List[torch.Tensor] = []
    off = 0
    for s in shapes:
        grads.append(buf[off : off + numel(s)].view(s))
        off += numel(s)
    return buf, whole, grads


def seeded_data(seed: int, step: int, rank: int, index: int, numel_: int) -> torch.Tensor:
    """Fresh standard normal gradients of one bucket, one stream per (seed, step, rank, bucket index)."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 10_007 * step + 101 * rank + index)
    return torch.randn(numel_, generator=g)


def rel_err64(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (a zero reference makes any difference huge, unlike :func:`rel_err`)."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def gs64(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of an (n, r) float64 matrix; a zero column stays zero."""
    x = x.clone()
    for i in range(x.shape[1]):
        norm = x[:, i].norm() + eps
        x[:, i] = x[:, i] / norm if norm > 0 else 0.0
        if i + 1 < x.shape[1]:
            x[:, i + 1 :] -= x[:, i : i + 1] * (x[:, i : i + 1] * x[:, i + 1 :]).sum(0, keepdim=True)
    return x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def layerwise(buf, grads, rank, min_rate=0.5) -> BucketLayout:
    return BucketLayout.from_gradients(buf, grads, rank, min_rate)


# ------------------------------------------------------------------------------------------ per-matrix comparisons
def matrix_slice(spec, which: str) -> slice:
    """Where one compressed matrix lives: ``"m"`` its segment of the bucket, ``"e"`` of the error memory, ``"p"``/``"q"``
    its factor in the packed P/Q buffers."""
    if which == "p":
        return slice(spec.p_offset, spec.p_offset + spec.n * spec.rank)
    if which == "q":
        return slice(spec.q_offset, spec.q_offset + spec.m * spec.rank)
    if which == "e":
        return slice(spec.e_offset, spec.e_offset + spec.numel)
    if which == "m":
        return slice(spec.offset, spec.offset + spec.numel)
    raise ValueError(f"which must be m, e, p or q, got {which!r}")


def per_matrix_errors(a: torch.Tensor, b: torch.Tensor, layout: BucketLayout, which: str,
                      scale: Optional[Dict[int, float]] = None) -> List[float]:
    """The error of ``a`` against the reference ``b`` on each compressed matrix's slice, in ``layout.matrices`` order:
    ``||a_i - b_i|| / ||b_i||`` in float64, or ``/ scale[id(spec)]`` when given (a product's error bound is relative
    to its factors' norms). NaN where a slice holds a non-finite value."""
    out = []
    for spec in layout.matrices:
        sl = matrix_slice(spec, which)
        x, ref = a[sl].double(), b[sl].double()
        if scale is None:
            denom = ref.norm().item()
        else:
            denom = scale[id(spec)]
        out.append((x - ref).norm().item() / (denom if denom > 0 else 1.0))
    return out


def assert_per_matrix(a: torch.Tensor, b: torch.Tensor, layout: BucketLayout, which: str, tol: float,
                      scale: Optional[Dict[int, float]] = None, what: str = "") -> None:
    """Assert every compressed matrix's error (:func:`per_matrix_errors`) is below ``tol``; a non-finite one fails.

    The failure names each matrix that broke: its index in the bucket, the gradient it is (``grad_index``), its shape
    ``n x m``, rank, the slice compared, the dtypes of ``a`` and of the reference, and its error; and how many
    elements of it are non-finite (an element a kernel never wrote reads as the tests' NaN poison).
    """
    bad = []
    for i, (spec, err) in enumerate(zip(layout.matrices, per_matrix_errors(a, b, layout, which, scale))):
        if err < tol:
            continue
        sl = matrix_slice(spec, which)
        nonfinite = int((~torch.isfinite(a[sl])).sum())
        bad.append(f"  matrix {i} (gradient {spec.grad_index}, {spec.n}x{spec.m}, rank {spec.rank}): {which}[{sl.start}:"
                   f"{sl.stop}] error {err:.3g}" + (f", {nonfinite} of {sl.stop - sl.start} elements non-finite"
                                                     if nonfinite or math.isnan(err) else ""))
    assert not bad, (f"{what + ': ' if what else ''}{len(bad)} of {len(layout.matrices)} matrices over {tol:g} "
                     f"({which}, {a.dtype} against a {b.dtype} reference):\n" + "\n".join(bad))


class Worst:
    """The largest of a series of errors and where it was, so that a failed assert names what broke.

    ``add(err, **where)`` (e.g. ``step=3, bucket=1, gradient=2, shape=(40, 48), dtype=torch.float32``); a NaN error is
    the worst of all and is kept. ``value`` is the largest error; ``str(worst)`` reads ``1.2e-03 at step 3, bucket 1,
    gradient 2, shape (40, 48), dtype torch.float32``. Picklable (the ranks of ``run_ranks`` return it);
    :meth:`merge` combines the ranks' ones.
    """

    def __init__(self):
        self.value = 0.0
        self.where: Dict[str, object] = {}

    def add(self, err: float, **where) -> None:
        if math.isnan(self.value):
            return
        if math.isnan(err) or err > self.value:
            self.value, self.where = float(err), {k: str(v) for k, v in where.items()}

    @staticmethod
    def merge(items) -> "Worst":
        out = Worst()
        for w in items:
            out.add(w.value, **w.where)
        return out

    def __str__(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in self.where.items())
        return f"{self.value:.3e}" + (f" at {where}" if where else "")


def add_per_gradient(worst: Worst, got: torch.Tensor, want: torch.Tensor, shapes, **where) -> None:
    """Add to ``worst`` the error of each gradient of a flat bucket (``shapes`` back to back), named by its index,
    shape and dtype (``got``'s, against ``want``'s) besides ``where``."""
    off = 0
    for i, s in enumerate(shapes):
        k = numel(s)
        worst.add(rel_err64(got[off : off + k], want[off : off + k]), **where, gradient=i, shape=tuple(s),
                  dtype=f"{got.dtype} vs {want.dtype}")
        off += k


def product_scale(layout, left, left_which, right, right_which, factor=1.0):
    """{id(spec): ‖left_i‖·‖right_i‖·factor} for :func:`bucket_utils.assert_per_matrix`."""
    return {
        id(s): left[matrix_slice(s, left_which)].double().norm().item()
        * right[matrix_slice(s, right_which)].double().norm().item()
        * factor
        for s in layout.matrices
    }


def factor(layout, which, gen, scale=1.0):
    """A random float32 P (``which="p"``) or Q factor of ``layout``, N(0, scale²) from ``gen``."""
    numel = layout.p_numel if which == "p" else layout.q_numel
    return torch.randn(numel, generator=gen) * scale
