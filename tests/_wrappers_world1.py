"""PyTorch's fp16/bf16 wrappers and ours around our hook, one process (world size 1), run as a script.

``python tests/_wrappers_world1.py cuda|cpu``: NCCL on cuda, gloo on cpu (where PyTorch's bf16 wrapper is refused by
name and skipped). Prints one JSON line per wrapper: registered name, iterations, memory dtypes, finiteness.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from powersgd_triton import PowerSGDState, powerSGD_hook  # noqa: E402
from powersgd_triton import teardown  # noqa: E402
from powersgd_triton.integrations import register  # noqa: E402
from powersgd_triton.wrappers import bf16_compress_wrapper  # noqa: E402


def main(device_name):
    device = torch.device(device_name)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        wrappers = {"torch_fp16": default_hooks.fp16_compress_wrapper, "ours_bf16": bf16_compress_wrapper}
        if device.type == "cuda":
            wrappers["torch_bf16"] = default_hooks.bf16_compress_wrapper
        for name, wrapper in wrappers.items():
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
            ddp = DDP(net.to(device), device_ids=[device.index or 0] if device.type == "cuda" else None)
            state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
            register(ddp, state, wrapper(powerSGD_hook))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            x, y = torch.randn(64, 64, device=device), torch.randint(0, 10, (64,), device=device)
            losses = []
            for _ in range(8):
                opt.zero_grad()
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            mem = state.buckets[0]
            print(json.dumps({
                "wrapper": name,
                "logged": ddp._get_ddp_logging_data().get("comm_hook"),
                "iter": state.iter,
                "bucket_dtype": str(mem.layout.signature[2]),
                "memory_dtypes": sorted({str(t.dtype) for t in (mem.error, mem.p, mem.q)}),
                "backend": mem.backend,
                "finite": all(bool(torch.isfinite(p).all()) for p in ddp.parameters()),
                "loss_went_down": losses[-1] < losses[0],
            }), flush=True)
        teardown.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
