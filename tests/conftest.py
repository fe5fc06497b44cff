"""Test setup: Triton's interpreter on CPU (must be set before triton is imported), one thread, fresh seeds."""

import os

if not os.environ.get("POWERSGD_TRITON_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def rng():
    """A torch.Generator with a fresh seed per test (printed on failure), so inputs differ from run to run."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def world1():
    """An in-process gloo world of size 1, torn down afterwards unless someone else made it."""
    import torch.distributed as dist

    from powersgd_triton import benchmarking as B

    mine = not dist.is_initialized()
    B.ensure_process_group("gloo")
    yield
    if mine and dist.is_initialized():
        dist.destroy_process_group()
