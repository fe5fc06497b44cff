"""What one rank of ``bench --link`` runs: every hook's DDP model of one workload, stepped in turn.

``python -m powersgd_triton.linkbench.ranks SPEC.json OUT.json`` (what the bench starts in each namespace, with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` set), or :func:`measure` in a
``torchrun`` rank. Each hook gets its own model from the same seed (same initial weights), its own DDP wrapper,
state and optimizer, made as the train command makes them (:func:`powersgd_triton.train.loop.make_hook`; PyTorch's
hook with one DDP bucket, which it needs on gloo, and ours with the same buckets: :func:`bucket_cap_mb`). Then,
step by step, every hook takes that step on the same batch, in an order that rotates each step (round robin), so
that whatever else loads the machine loads every hook alike.

A step is timed from ``zero_grad`` to the end of ``optimizer.step()`` (the backward pass waits for the hook's
all-reduces); the step time of the job is the slowest rank's (per step, the maximum over ranks). Bytes are what
goes through ``dist.all_reduce`` on a rank, counted as the train command counts them
(:class:`~powersgd_triton.train.counting.AllReduceCounter`): DDP's broadcasts and the timing's own all-reduce at the
end are not in them.
"""

import gc
import os
import sys
import time
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from powersgd_triton.linkbench import workloads
from powersgd_triton.linkbench.names import ALLREDUCE, REFERENCE, Spec, train_hook
from powersgd_triton.train.config import REFERENCE_BUCKET_CAP_MB


def _device(spec: Spec) -> torch.device:
    if spec.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def bucket_cap_mb(spec: Spec, hook_name: str, device: torch.device) -> Optional[float]:
    """DDP's ``bucket_cap_mb`` for ``hook_name`` (a train command name), ``None`` for DDP's default.

    PyTorch's hook on gloo gets one bucket (it orders its collectives from gloo's worker threads and aborts with
    several). Our hooks get the same buckets as PyTorch's hook, so that the two compressed hooks are compared on the
    same layout and the same number of all-reduce calls; ``spec.bucket_cap_mb`` sets ours and all-reduce's instead.
    All-reduce keeps DDP's default buckets (its first bucket's all-reduce runs while the backward goes on)."""
    one_bucket = REFERENCE_BUCKET_CAP_MB if device.type != "cuda" else None
    if hook_name == REFERENCE:
        return one_bucket
    if spec.bucket_cap_mb is not None:
        return spec.bucket_cap_mb
    return None if hook_name == ALLREDUCE else one_bucket


def measure(spec: Spec) -> Optional[Dict[str, Any]]:
    """Run ``spec`` as the rank ``env://`` names (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Returns, on rank 0, ``{"rate", "workload", "world_size", "batch_size", "timed_steps", "hooks": {hook:
    {"step_ms": [float, one per timed step], "bytes_per_step", "calls_per_step", "kernel_backend", "bucket_cap_mb",
    "final_loss"}}, "environment": {...}}``; ``None``
    on the other ranks. Raises what the workload, DDP or a collective raises (a rank that fails makes the others
    fail at their next collective, or at ``spec.collective_timeout``)."""
    from powersgd_triton import teardown

    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = _device(spec)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=spec.collective_timeout))
    try:
        return _measure(spec, dist.get_rank(), dist.get_world_size(), device)
    finally:
        gc.collect()  # DDP's reducers hold the group (see powersgd_triton.teardown)
        teardown.destroy_process_group()


def _measure(spec: Spec, rank: int, world: int, device: torch.device) -> Optional[Dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from powersgd_triton.train.config import TrainConfig
    from powersgd_triton.train.counting import AllReduceCounter
    from powersgd_triton.train.loop import make_hook

    total = spec.start_iter + spec.steps
    wl = workloads.make(spec.workload, batch_size=spec.batch_size, seed=spec.seed, rank=rank, world_size=world,
                        steps=total)
    runs = []
    for name in spec.hooks:
        hook_name, dtype = train_hook(name)
        torch.manual_seed(spec.seed)
        model = wl.model().to(device)
        kwargs: Dict[str, Any] = {}
        cap = bucket_cap_mb(spec, hook_name, device)
        if cap is not None:
            kwargs["bucket_cap_mb"] = cap
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        ddp = DDP(model, **kwargs)
        # on CPU our hooks run their torch backend, never Triton's interpreter (TRITON_INTERPRET=1 in the
        # environment would pick it): the interpreter is a test tool, not something to time
        cfg = TrainConfig(matrix_approximation_rank=spec.matrix_approximation_rank, start_iter=spec.start_iter,
                          seed=spec.seed, communication_dtype=dtype, device=device.type,
                          kernels="torch" if device.type == "cpu" else "auto")
        state, hook = make_hook(hook_name, cfg)
        ddp.register_comm_hook(state, hook)
        runs.append((name, ddp, wl.optimizer(ddp.parameters()), state))

    n = len(runs)
    seconds = torch.zeros(n, total, dtype=torch.float64)
    sent = [[0] * total for _ in range(n)]
    calls = [[0] * total for _ in range(n)]
    last_loss = [float("nan")] * n
    counter = AllReduceCounter().install()
    try:
        counter.take()
        for step in range(total):
            x, y = (t.to(device) for t in wl.batch(step, rank, world))
            for k in range(n):
                i = (step + k) % n  # round robin: each hook goes first in turn
                _, ddp, opt, _ = runs[i]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = wl.loss(ddp, x, y)
                loss.backward()
                if wl.clip:
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), wl.clip)
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds[i, step] = time.perf_counter() - t0
                sent[i][step], calls[i][step] = counter.take()
                last_loss[i] = float(loss.item())
    finally:
        counter.uninstall()
    times = seconds.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the job's step time: its slowest rank's
    times = times.cpu()
    if rank != 0:
        return None
    from powersgd_triton.benchmarking.environment import environment

    timed = range(spec.start_iter, total)
    out: Dict[str, Any] = {"rate": spec.rate, "workload": spec.workload, "world_size": world,
                           "batch_size": wl.batch_size, "timed_steps": spec.steps, "hooks": {},
                           "environment": environment(device)}
    for i, (name, _, _, state) in enumerate(runs):
        backends = sorted({str(m.backend) for m in getattr(state, "buckets", {}).values()
                           if getattr(m, "backend", None)})
        out["hooks"][name] = {
            "step_ms": [1000.0 * float(times[i, s]) for s in timed],
            "bytes_per_step": sum(sent[i][s] for s in timed) / len(timed),
            "calls_per_step": sum(calls[i][s] for s in timed) / len(timed),
            "kernel_backend": ",".join(backends) or None,
            "bucket_cap_mb": bucket_cap_mb(spec, train_hook(name)[0], device),
            "final_loss": last_loss[i],
        }
    del runs
    return out


def main(argv=None) -> int:
    """``python -m powersgd_triton.linkbench.ranks SPEC.json OUT.json``: rank 0 writes its result to OUT.json."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m powersgd_triton.linkbench.ranks SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = Spec.from_json(f.read())
    result = measure(spec)
    if result is not None:
        from powersgd_triton.cache_files import atomic_write_json

        atomic_write_json(argv[1], result, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
