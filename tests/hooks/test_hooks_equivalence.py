"""Our hooks against PyTorch's ``powerSGD_hook`` and against a float64 implementation of the batched algorithm.

Both hooks get the same data on gloo ranks (world sizes 1, 2, 4), through fake buckets: three buckets per step
(one with nothing to compress), fresh random data every step, shapes that are compressed at some ranks and not at
others, full-rank matrices so the compression is lossy, 5 compressed steps after 2 plain ones. PyTorch's hook is
waited on per bucket (its callbacks issue collectives from gloo's worker threads, which is only safe one bucket at
a time). The error measure is per gradient: ||ours - theirs|| / ||theirs||, max over gradients, buckets and steps.
PyTorch orthogonalizes with QR for rank > 2: the columns of P may differ in sign, P·Pᵀ·M does not.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from _dist import FakeBucket, backend_params, bucket_numel, run_ranks
from bucket_utils import Worst, add_per_gradient, gs64, rel_err64, seeded_data
from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

pytestmark = pytest.mark.timeout(240)

TOL = 1e-5
START = 2
COMPRESSED_STEPS = 5

# (bucket index, is_last, gradient shapes), in the order DDP would call the hook.
BUCKETS = [
    (2, False, [(7,), (3, 2)]),  # nothing compressed
    (1, False, [(40, 48), (12,), (16, 8, 3, 3), (16,), (40, 48), (64, 36), (5,)]),
    (0, True, [(24, 20), (30, 2, 5), (20,), (48, 40), (1, 1, 3)]),
]

CONFIGS = [
    dict(matrix_approximation_rank=r, use_error_feedback=ef, warm_start=ws)
    for r, ef, ws in itertools.product((1, 2, 4, 8), (True, False), (True, False))
] + [
    dict(matrix_approximation_rank=2, batch_tensors_with_same_shape=True),
    dict(matrix_approximation_rank=4, batch_tensors_with_same_shape=True, use_error_feedback=False),
    dict(matrix_approximation_rank=1, orthogonalization_epsilon=1e-8, random_seed=7),
]


def _name(cfg):
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _layerwise_worker(rank, world_size, backend, buckets=BUCKETS, configs=CONFIGS):
    out = {}
    for ci, cfg in enumerate(configs):
        ours = PowerSGDState(None, start_powerSGD_iter=START, backend=backend, **cfg)
        theirs = torch_psgd.PowerSGDState(None, start_powerSGD_iter=START, **cfg)
        worst = Worst()
        for step in range(START + COMPRESSED_STEPS):
            for index, is_last, shapes in buckets:
                data = seeded_data(ci, step, rank, index, bucket_numel(shapes))
                a = FakeBucket(data.clone(), shapes, index, is_last)
                b = FakeBucket(data.clone(), shapes, index, is_last)
                got = powerSGD_hook(ours, a).wait()
                want = torch_psgd.powerSGD_hook(theirs, b).wait()
                assert got.shape == want.shape and got.dtype == want.dtype
                assert got.data_ptr() == a.buffer().data_ptr()  # in place, no copy of the bucket
                assert torch.isfinite(got).all(), (step, index)
                add_per_gradient(worst, got, want, shapes, rank=rank, step=step, bucket=index)
            assert ours.iter == theirs.iter == step + 1
        assert ours.compression_stats() == theirs.compression_stats(), (ours.compression_stats(), theirs.compression_stats())
        out[_name(cfg)] = worst
    return out


class BatchedOracle:
    """The batched PowerSGD algorithm in float64 for all ranks at once (no communication needed).

    As PyTorch's ``batched_powerSGD_hook``: the bucket is zero-padded to ``s * s`` and the error memory covers the
    whole padded matrix (``error = padded input - P·Qᵀ``, padding included), so the padding's error feeds the next
    step's products.
    """

    def __init__(self, world_size, matrix_approximation_rank, use_error_feedback=True, warm_start=True,
                 orthogonalization_epsilon=0.0, random_seed=0, **_):
        self.ws = world_size
        self.rank = matrix_approximation_rank
        self.ef = use_error_feedback
        self.warm = warm_start
        self.eps = float(orthogonalization_epsilon)
        self.rng = np.random.RandomState(random_seed)
        self.err = {}
        self.q = {}

    def step(self, index, datas, compress):
        n = datas[0].numel()
        if not compress:
            return sum(d.double() for d in datas) / self.ws
        s = math.isqrt(n)
        s += s * s < n
        r = min(s, self.rank)
        ms = []
        for k, d in enumerate(datas):
            m = torch.zeros(s * s, dtype=torch.float64)
            m[:n] = d.double()
            if self.ef and (index, k) in self.err:
                m += self.err[(index, k)]  # s * s elements: the padding's error too
            ms.append(m.view(s, s))
        if index not in self.q or not self.warm:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                self.q[index] = torch.randn(s, r, dtype=datas[0].dtype).double()
        q = gs64(self.q[index], self.eps)
        p = gs64(sum(m @ q for m in ms), self.eps)
        q = sum(m.t() @ p for m in ms) / self.ws
        approx = (p @ q.t()).reshape(-1)
        if self.ef:
            for k, m in enumerate(ms):
                self.err[(index, k)] = m.reshape(-1) - approx
        self.q[index] = q
        return approx[:n]


# The batched view of a bucket of N elements is s x s, s = ceil(sqrt(N)). Buckets here keep s >= 2r: when the rank
# reaches s the factorization is full rank and fp32 Gram-Schmidt of an ill-conditioned s x s P loses ~1e-5 against
# float64 (a property of fp32, checked separately with a looser bound in test_batched_full_rank_bucket).
BATCHED_BUCKETS = [
    (2, False, [(7,), (3, 2), (137,)]),
    BUCKETS[1],
    BUCKETS[2],
]

BATCHED_CONFIGS = [
    dict(matrix_approximation_rank=r, use_error_feedback=ef, warm_start=ws)
    for r, ef, ws in itertools.product((1, 2, 4, 8), (True, False), (True, False))
] + [dict(matrix_approximation_rank=2, orthogonalization_epsilon=1e-8, random_seed=3)]


def _batched_worker(rank, world_size, backend, buckets=BATCHED_BUCKETS, configs=BATCHED_CONFIGS):
    out = {}
    for ci, cfg in enumerate(configs):
        ours = PowerSGDState(None, start_powerSGD_iter=START, backend=backend, **cfg)
        oracle = BatchedOracle(world_size, **cfg)
        worst = Worst()
        for step in range(START + COMPRESSED_STEPS):
            for index, is_last, shapes in buckets:
                n = bucket_numel(shapes)
                datas = [seeded_data(ci, step, k, index, n) for k in range(world_size)]
                want = oracle.step(index, datas, step >= START)
                got = batched_powerSGD_hook(ours, FakeBucket(datas[rank].clone(), shapes, index, is_last)).wait()
                assert got.shape == (n,) and torch.isfinite(got).all()
                worst.add(rel_err64(got, want), rank=rank, step=step, bucket=index, numel=n, dtype=got.dtype)
        out[_name(cfg)] = worst
    return out


# 4 gloo ranks on a 2-core machine take ~10 ms per all-reduce: at world size 4 the full rank x error-feedback x
# warm-start product runs on one bucket holding the gradients of buckets 1 and 0 (every shape kind is in it).
MERGED_BUCKET = [(0, True, BUCKETS[1][2] + BUCKETS[2][2])]
CORE_CONFIGS = CONFIGS[:16]
BATCHED_CORE_CONFIGS = BATCHED_CONFIGS[:16]

# The Triton kernels run in Triton's interpreter here (0.1-0.5 s per step and bucket). They get, on one bucket with
# every kind of gradient, four configurations per world size that cover every rank and both settings of error
# feedback and warm start: TRITON_COVER on world sizes 2 and 4, its complement (the other setting of both flags at
# each rank) on world size 1, so the eight cases of rank x flags between them. The torch backend runs everything
# above; the hook code is the same for both backends, only the four bucket steps differ.
TRITON_BUCKET = [(0, True, [(40, 48), (12,), (16, 8, 3, 3), (40, 48), (64, 36), (5,)])]
TRITON_COVER = [
    dict(matrix_approximation_rank=1, use_error_feedback=True, warm_start=True),
    dict(matrix_approximation_rank=2, use_error_feedback=False, warm_start=True),
    dict(matrix_approximation_rank=4, use_error_feedback=True, warm_start=False),
    dict(matrix_approximation_rank=8, use_error_feedback=False, warm_start=False),
]
TRITON_COVER_WORLD1 = [dict(c, use_error_feedback=not c["use_error_feedback"], warm_start=not c["warm_start"])
                       for c in TRITON_COVER]


def _worker_args(world_size, backend, full_buckets, full_configs, core_configs):
    if backend == "triton":
        return TRITON_BUCKET, (TRITON_COVER_WORLD1 if world_size == 1 else TRITON_COVER)
    if world_size >= 4:
        return MERGED_BUCKET, core_configs
    return full_buckets, full_configs


def _check(results, world_size, tol=TOL):
    for name in results[0]:
        worst = Worst.merge(r[name] for r in results)
        print(f"world={world_size} {name}: max rel err {worst}")
        assert worst.value < tol, f"world={world_size} {name}: max relative error {worst} >= {tol}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_layerwise_matches_pytorch(tmp_path, world_size, backend):
    buckets, configs = _worker_args(world_size, backend, BUCKETS, CONFIGS, CORE_CONFIGS)
    results = run_ranks(_layerwise_worker, world_size, tmp_path, backend, buckets, configs, timeout=170)
    _check(results, world_size)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batched_matches_float64_oracle(tmp_path, world_size, backend):
    buckets, configs = _worker_args(world_size, backend, BATCHED_BUCKETS, BATCHED_CONFIGS, BATCHED_CORE_CONFIGS)
    results = run_ranks(_batched_worker, world_size, tmp_path, backend, buckets, configs, timeout=170)
    _check(results, world_size)


@pytest.mark.parametrize("backend", backend_params())
def test_batched_full_rank_bucket(tmp_path, backend):
    """A 13-element bucket is a 4 x 4 matrix: ranks 4 and 8 are full rank (r = min(s, rank)), still correct."""
    buckets = [(0, True, [(7,), (3, 2)])]
    configs = [dict(matrix_approximation_rank=r) for r in (1, 4, 8)]
    results = run_ranks(_batched_worker, 2, tmp_path, backend, buckets, configs, timeout=60)
    _check(results, 2, tol=1e-3)
