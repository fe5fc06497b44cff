"""Helpers for kernel tests: buckets of gradients in a flat buffer, canary guards, float64 oracle."""

from typing import List, Sequence, Tuple

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
