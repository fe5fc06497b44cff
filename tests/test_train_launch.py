"""The local launcher of ``powersgd-triton train``: results, failures, deaths, timeouts, ports; the all-reduce
counter with real gloo collectives (under the fork server). Workers are module-level functions."""

import os
import socket
import time

import pytest
import torch

from _deadline import scaled

from powersgd_triton import teardown
from powersgd_triton.train import launch
from powersgd_triton.train.loop import AllReduceCounter


def _ok(rank, world_size, init_method, value):
    return {"rank": rank, "world": world_size, "value": value, "init": init_method}


def _raise_on_1(rank, world_size, init_method):
    if rank == 1:
        raise ValueError("boom from rank one")
    time.sleep(60)  # rank 0 would wait forever in a collective


def _die_on_1(rank, world_size, init_method):
    if rank == 1:
        os._exit(7)
    time.sleep(60)


def _sleep(rank, world_size, init_method):
    time.sleep(60)


def _count_allreduce(rank, world_size, init_method):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    original = dist.all_reduce
    try:
        with AllReduceCounter() as counter:
            patched = dist.all_reduce is not original
            t = torch.ones(10, dtype=torch.float32) * (rank + 1)
            dist.all_reduce(t)
            h = torch.ones(3, dtype=torch.float16)
            dist.all_reduce(h, async_op=True).wait()
            b, c = counter.take()
            after = counter.take()
        untouched = patched and dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
        dist.barrier()
        return {"bytes": b, "calls": c, "after": after, "sum": t.tolist(), "restored": untouched}
    finally:
        teardown.destroy_process_group()


def test_returns_rank0_value():
    out = launch.launch(_ok, 2, ("x",), timeout=scaled(60))
    assert out["rank"] == 0 and out["world"] == 2 and out["value"] == "x"
    assert out["init"].startswith("tcp://127.0.0.1:")


def test_rank_error_is_reported_promptly():
    t0 = time.monotonic()
    with pytest.raises(launch.RankFailed) as info:
        launch.launch(_raise_on_1, 2, timeout=scaled(60))
    assert time.monotonic() - t0 < 20
    assert info.value.rank == 1
    assert "ValueError: boom from rank one" in str(info.value)


def test_silent_death_is_reported():
    t0 = time.monotonic()
    with pytest.raises(launch.RankFailed, match="rank 1 failed") as info:
        launch.launch(_die_on_1, 2, timeout=scaled(60))
    assert "exited with code 7" in str(info.value)
    assert time.monotonic() - t0 < 20


def test_timeout_stops_every_rank():
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchTimeout, match="did not finish within 2 s"):
        launch.launch(_sleep, 2, timeout=2)
    assert time.monotonic() - t0 < 15


def test_bad_world_size_and_taken_port():
    with pytest.raises(launch.LaunchError, match="at least 1"):
        launch.launch(_ok, 0, ("x",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(launch.PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            launch.launch(_ok, 2, ("x",), port=port)


def test_torchrun_env():
    assert launch.torchrun_env({}) is None
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    tr = launch.torchrun_env(env)
    assert (tr.rank, tr.world_size, tr.local_rank) == (1, 4, 1)


def test_counter_counts_what_goes_through_all_reduce():
    # the fork server: a rank forked from this pytest-xdist worker inherits what earlier tests left in it (their gloo
    # groups' C++ objects without their threads); with real gloo collectives that once ended rank 0 with SIGSEGV
    out = launch.launch(_count_allreduce, 2, timeout=scaled(60), start_method="forkserver")
    assert out["bytes"] == 10 * 4 + 3 * 2
    assert out["calls"] == 2
    assert out["after"] == (0, 0)
    assert out["sum"] == [3.0] * 10
    assert out["restored"]
