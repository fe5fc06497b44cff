"""Launches per compressed step do not depend on how many matrices a bucket holds (one gloo rank)."""

import pytest
import torch

from _dist import FakeBucket, bucket_numel, run_ranks
from _launches import CountLaunches, counting_bucket_kernels
from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

pytestmark = pytest.mark.timeout(60)


def _shapes(layers):
    shapes = []
    for i in range(layers):
        shapes += [(16 + i, 24 + 2 * i), (16 + i,)]
    return shapes


def _count_worker(rank, world_size, layers, batched):
    hook = batched_powerSGD_hook if batched else powerSGD_hook
    shapes = _shapes(layers)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, backend="torch")
    for _ in range(3):  # 2 plain steps, then the first compressed one (it draws the random Q)
        hook(state, FakeBucket(torch.randn(bucket_numel(shapes)), shapes)).wait()
    bucket = FakeBucket(torch.randn(bucket_numel(shapes)), shapes)
    counter = CountLaunches()
    with counting_bucket_kernels(counter), counter:
        hook(state, bucket).wait()
    return {"ops": dict(counter.ops), "kernels": dict(counter.kernels), "collectives": sum(counter.collectives.values())}


@pytest.mark.parametrize("batched", [False, True], ids=["layerwise", "batched"])
def test_launches_independent_of_matrix_count(tmp_path, batched):
    few, many = (run_ranks(_count_worker, 1, tmp_path, layers, batched, timeout=60)[0] for layers in (2, 30))
    assert few == many, (few, many)
    # orthogonalize: P's; the next step's Q is orthogonalized inside reconstruct on the CPU torch backend (whose
    # Gram matrices tell the step status: reference.status_and_orthogonalization), by a launch of its own elsewhere
    # (layer-wise: the biases lie in several ranges of the bucket, packed by project's launch: no pack of its own)
    expected = {"orthogonalize": 1, "project": 1, "project_t": 1, "average": 1, "reconstruct": 1}
    assert few["kernels"] == expected
    assert few["collectives"] == (2 if batched else 3)
    assert sum(few["ops"].values()) <= 2, few["ops"]
