"""Kernel launches per PowerSGD step do not grow with the number of matrices in a bucket."""

import pytest
import torch

from bucket_utils import layerwise, make_bucket
from powersgd_triton import benchmarking as B
from powersgd_triton import ops
from powersgd_triton.shapes import model_shapes

triton = pytest.importorskip("triton")


@pytest.fixture
def launches():
    """``{"n": launches so far}`` (interpreted Triton launches), for the whole test. The kernels are not run
    (``execute=False``): the launch sequence depends on the shapes only, and the numbers are tested in test_kernels."""
    with B.count_triton_launches(execute=False) as count:
        yield count


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
    shapes = B.shrink_shapes(model_shapes("resnet50"), 4)  # channel dims only: the interpreter stays fast
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


def test_project_packs_in_its_own_launch(launches, rng):
    """The layer-wise hook's step: project packs the uncompressed gradients (several ranges) in its one launch."""
    shapes = B.shrink_shapes(model_shapes("resnet50"), 4)
    buf, _, grads = make_bucket(shapes, torch.float32, rng)
    layout = layerwise(buf, grads, 4, min_rate=2)
    assert len(layout.uncompressed) > 1
    q = torch.randn(layout.q_numel, generator=rng)
    p, err = torch.empty(layout.p_numel), torch.zeros(layout.e_numel)
    packed = torch.empty(layout.uncompressed_numel)
    launches["n"] = 0
    ops.project(buf, layout, q, p, err, packed=packed, backend="triton")
    assert launches["n"] == 1
    launches["n"] = 0
    _step(buf, layout, rng)  # the whole step without the pack: 5, so with it (inside project) still 5
    assert launches["n"] == 5
