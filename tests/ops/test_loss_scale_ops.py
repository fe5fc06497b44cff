"""Loss-scale-aware error feedback at the op level (``loss_scale`` of ops.project / project_t / reconstruct), both
backends, against the float64 oracle run in scaled units: with the bucket holding ``s·g`` and the error memory
``E`` unscaled, the ops must compute what the plain ops compute on ``s·g`` with the error ``s·E``, and store the new
error divided by ``s``. Also the batched view (its padding's error takes part) and the alternating hook's local
residual; a bad ``loss_scale`` is refused before anything changes.
"""

import pytest
import torch

from bucket_utils import layerwise, make_bucket, rel_err
from powersgd_triton import ops
from powersgd_triton.ops import reference
from powersgd_triton.layout import BucketLayout

pytest.importorskip("triton")

SHAPES = [(16, 3, 3), (16,), (10, 24), (7, 33)]


def _layout(kind, dtype, rng):
    if kind == "batched":
        buf = (torch.randn(150, generator=rng)).to(dtype)
        return buf, BucketLayout.batched(buf.numel(), 3, "cpu", dtype)
    buf, _, grads = make_bucket(SHAPES, dtype, rng)
    return buf, layerwise(buf, grads, 3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["layerwise", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_step_with_loss_scale_matches_scaled_oracle(backend, kind, dtype, rng):
    s = 768.0  # not a power of two: the division by s is not exact in the kernels either
    buf, layout = _layout(kind, dtype, rng)
    buf.mul_(s)  # the scaled gradients
    err = torch.randn(layout.e_numel, generator=rng) * 0.5
    q0 = torch.randn(layout.q_numel, generator=rng)
    loss_scale = torch.tensor([s])

    # oracle in float64, scaled units
    buf64, err64 = buf.double(), err.double() * s
    q64 = reference.orthogonalize(q0.double(), layout, "q", 0.0, out=q0.double().clone(), compute_dtype=torch.float64)
    p64 = torch.zeros(layout.p_numel, dtype=torch.float64)
    reference.project(buf64, layout, q64, p64, err64, torch.float64)
    reference.orthogonalize(p64, layout, "p", 0.0, compute_dtype=torch.float64)
    reference.project_t(buf64, layout, p64, q64, torch.float64, error=err64 if layout.batched else None)
    reference.reconstruct(buf64, layout, p64, q64, 1.0, err64, None, torch.float64)

    q = torch.empty_like(q0)
    p = torch.empty(layout.p_numel)
    ops.orthogonalize(q0, layout, "q", 0.0, out=q, backend=backend)
    ops.project(buf, layout, q, p, err, loss_scale=loss_scale, backend=backend)
    ops.orthogonalize(p, layout, "p", 0.0, backend=backend)
    ops.project_t(buf, layout, p, q, error=err if layout.batched else None, loss_scale=loss_scale, backend=backend)
    ops.reconstruct(buf, layout, p, q, 1.0, err, torch.tensor(True), loss_scale=loss_scale, backend=backend)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(q, q64) < tol * 10
    assert rel_err(buf, buf64) < tol
    # the error memory is unscaled: (M + s·E - P·Qᵀ) / s
    assert rel_err(err, err64 / s) < tol * 10


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_local_residual_with_loss_scale(backend, rng):
    """The alternating hook's P step: E <- (M + s·E - P_local·Qᵀ) / s, output P·Qᵀ (scaled units)."""
    s = 1024.0
    buf, layout = _layout("layerwise", torch.float32, rng)
    buf.mul_(s)
    err = torch.randn(layout.e_numel, generator=rng)
    p = torch.randn(layout.p_numel, generator=rng)
    local_p = torch.randn(layout.p_numel, generator=rng)
    q = torch.randn(layout.q_numel, generator=rng)
    buf64, err64 = buf.double(), err.double() * s
    reference.reconstruct(buf64, layout, p.double(), q.double(), 1.0, err64, None, torch.float64,
                          local_p=local_p.double())
    ops.reconstruct(buf, layout, p, q, 1.0, err, torch.tensor(True), local_p=local_p,
                    loss_scale=torch.tensor([s]), backend=backend)
    assert rel_err(buf, buf64) < 1e-5
    assert rel_err(err, err64 / s) < 1e-5


@pytest.mark.parametrize("bad", [torch.tensor([2.0, 2.0]), torch.tensor([2.0], dtype=torch.float64),
                                 torch.tensor([2.0], device="meta")], ids=["two", "float64", "meta"])
def test_bad_loss_scale_is_refused_and_changes_nothing(bad, rng):
    buf, layout = _layout("layerwise", torch.float32, rng)
    err = torch.randn(layout.e_numel, generator=rng)
    q = torch.randn(layout.q_numel, generator=rng)
    p = torch.zeros(layout.p_numel)
    before, err_before = buf.clone(), err.clone()
    with pytest.raises(ValueError, match="loss_scale"):
        ops.project(buf, layout, q, p, err, loss_scale=bad, backend="torch")
    with pytest.raises(ValueError, match="loss_scale"):
        ops.reconstruct(buf, layout, p, q, 1.0, err, loss_scale=bad, backend="torch")
    assert torch.equal(buf, before) and torch.equal(err, err_before)


def test_torch_backend_grouped_path_applies_the_loss_scale(rng):
    """Same-shape float32 matrices take the torch backend's grouped (bmm) path: with ``loss_scale`` s and unscaled
    E it equals the plain ops run on the scaled error s·E, and stores the new error divided by s."""
    shapes = [(12, 10)] * 4 + [(6, 8)] * 3
    buf, _, grads = make_bucket(shapes, torch.float32, rng)
    layout = layerwise(buf, grads, 2)
    q = torch.randn(layout.q_numel, generator=rng)
    e = torch.randn(layout.e_numel, generator=rng)
    assert reference._grouped(layout, torch.float32, buf, q, torch.zeros(layout.p_numel), e) is not None
    s = torch.tensor([2.0 ** 10 * float(torch.rand((), generator=rng) + 0.5)])
    b1, p1, e1 = buf.clone(), torch.zeros(layout.p_numel), e.clone()
    b2, p2, e2 = buf.clone(), torch.zeros(layout.p_numel), e * s
    reference.project(b1, layout, q, p1, e1, loss_scale=s)
    reference.project(b2, layout, q, p2, e2)
    assert rel_err(p1, p2) < 1e-6 and rel_err(b1, b2) < 1e-6
    reference.reconstruct(b1, layout, p1, q, 0.5, e1, loss_scale=s)
    reference.reconstruct(b2, layout, p2, q, 0.5, e2)
    assert rel_err(b1, b2) < 1e-6 and rel_err(e1 * s, e2) < 1e-5
