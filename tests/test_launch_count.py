"""Kernel launches per PowerSGD step do not grow with the number of matrices in a bucket."""

import pytest
import torch

from bucket_utils import layerwise, make_bucket
from powersgd_triton import ops
from powersgd_triton.shapes import model_shapes

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def _scaled(shape, div=4):
    """Shrink channel dims (not 3x3/7x7 kernel dims) so the interpreter stays fast; the tensor count is unchanged."""
    if len(shape) == 4:
        return (max(1, shape[0] // div), max(1, shape[1] // div), shape[2], shape[3])
    return tuple(max(1, d // div) for d in shape)


@pytest.fixture
def launches(monkeypatch):
    count = {"n": 0}
    original = InterpretedFunction.run

    def counting_run(self, *args, **kwargs):
        count["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting_run)
    return count


def _step(buf, layout, gen):
    q = torch.randn(layout.q_numel, generator=gen)
    p = torch.empty(layout.p_numel)
    err = torch.zeros(layout.e_numel)
    ops.orthogonalize(q, layout, "q", backend="triton")  # warm-start Q
    ops.project(buf, layout, q, p, err, backend="triton")
    ops.orthogonalize(p, layout, "p", backend="triton")
    ops.project_t(buf, layout, p, q, backend="triton")
    ops.reconstruct(buf, layout, p, q, 0.5, err, torch.tensor(True), backend="triton")


def test_resnet50_bucket_step_launches(launches, rng):
    shapes = [_scaled(s) for s in model_shapes("resnet50")]
    assert len(shapes) == 161
    buf, _, grads = make_bucket(shapes, torch.float32, rng)
    layout = layerwise(buf, grads, 4, min_rate=2)
    assert layout.num_matrices >= 45
    _step(buf, layout, rng)
    print(f"ResNet-50-shaped bucket: {layout.num_matrices} compressed matrices, {launches['n']} kernel launches")
    assert launches["n"] <= 8


def test_launches_do_not_grow_with_matrix_count(launches, rng):
    counts = {}
    for n_matrices in (2, 150):
        shapes = [(9 + i % 7, 11 + i % 5) for i in range(n_matrices)]
        buf, _, grads = make_bucket(shapes, torch.float32, rng)
        layout = layerwise(buf, grads, 2)
        assert layout.num_matrices == n_matrices
        launches["n"] = 0
        _step(buf, layout, rng)
        counts[n_matrices] = launches["n"]
    assert counts[2] == counts[150] == 5, counts
