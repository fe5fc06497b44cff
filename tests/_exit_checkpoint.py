"""A 2-rank torchrun checkpoint script as a user writes it, for the exit test (issue 40 item 5).

Trains a small MLP with DDP and our ``powerSGD_hook`` on gloo for a few steps, saves the hook state
(``powersgd_triton.checkpoint``), restores it into a fresh DDP and state, trains a few more steps, then ends with
``--teardown``: ``torch`` (a plain ``dist.destroy_process_group()``, as issue 40 item 5 found it) or ``ours``
(``powersgd_triton.teardown.destroy_process_group()``, the documented teardown). ``--hook``: ours, PyTorch's or none
(plain DDP). ``tests/_exit_loop.py`` runs it many times and counts the aborts.

    torchrun --standalone --nproc-per-node 2 tests/_exit_checkpoint.py --dir /tmp/ck --teardown torch
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as pytorch_powersgd

from powersgd_triton import PowerSGDState, powerSGD_hook
from powersgd_triton.checkpoint import load_hook_state, save_hook_state

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
ap.add_argument("--teardown", choices=("torch", "ours"), default="torch")
ap.add_argument("--hook", choices=("ours", "pytorch", "none"), default="ours")
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
ddp = DDP(module)
state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
if args.hook == "ours":
    ddp.register_comm_hook(state, powerSGD_hook)
elif args.hook == "pytorch":
    ddp.register_comm_hook(pytorch_powersgd.PowerSGDState(None, 2, start_powerSGD_iter=2), pytorch_powersgd.powerSGD_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + rank)


def train(model, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 32, generator=gen)).square().mean().backward()
        opt.step()


train(ddp, args.steps)
if args.hook == "ours":
    save_hook_state(state, ddp, args.dir)
dist.barrier()

fresh = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
ddp2 = DDP(module)
if args.hook == "ours":
    ddp2.register_comm_hook(fresh, powerSGD_hook)
    load_hook_state(fresh, ddp2, args.dir)
    assert fresh.iter == args.steps, fresh.iter
train(ddp2, args.steps)
if rank == 0:
    print("trained", flush=True)

if args.teardown == "ours":
    from powersgd_triton import teardown
    teardown.destroy_process_group()
else:
    dist.destroy_process_group()
