"""DDP + powersgd_triton under torchrun, with checkpoints every N steps and exact resume after a restart.

Self-contained: a small MLP on synthetic regression data drawn per (step, rank), so nothing is downloaded. Every
``--checkpoint-every`` steps it writes ``DIR/step_XXXXXX/``: ``train.pt`` (model, optimizer, LR schedule, step; from
rank 0: they are the same on every rank under DDP) and ``hook_state.rank{r}.pt`` from **every** rank (PowerSGD's
error-feedback memory is each rank's own; see ``powersgd_triton.checkpoint``), then points ``DIR/latest`` at it. Started
again with the same arguments -- by hand, or by torchrun itself after a worker failure (``--max-restarts``) -- it
resumes from ``DIR/latest`` and ends with the same parameters as an uninterrupted run, bit for bit (CPU/gloo).

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --steps 40 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --steps 40 --checkpoint-dir ckpt --stop-after 25
    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --steps 40 --checkpoint-dir ckpt   # resumes
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/torchrun_ddp.py --steps 40 \\
        --checkpoint-dir ckpt2 --fail-at-step 25   # rank 1 dies once at step 25; torchrun restarts, it resumes

Options: ``--hook powersgd|alternating|batched|allreduce`` (resumes are exact for the first two; the batched hook
restarts its memory with a warning), ``--matrix-approximation-rank`` (PowerSGD's r, not a process rank; ``--rank``
still works and warns), ``--start-iter``,
``--checkpoint-every``, ``--bucket-cap-mb``, ``--device cpu|cuda``, ``--out final.pt`` (rank 0 saves the final
parameters and a summary). Only ``powersgd_triton`` and ``torch`` are needed.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook, teardown
from powersgd_triton.checkpoint import load_hook_state, save_hook_state
from powersgd_triton.cli import DeprecatedAlias
from powersgd_triton.integrations import register

IN, HIDDEN, OUT = 64, 128, 16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="total optimizer steps")
    ap.add_argument("--hook", choices=("powersgd", "alternating", "batched", "allreduce"), default="powersgd")
    ap.add_argument("--matrix-approximation-rank", "--approx-rank", dest="matrix_approximation_rank", type=int,
                    default=2, help="PowerSGD's matrix approximation rank r (not the process rank)")
    ap.add_argument("--rank", dest="matrix_approximation_rank", type=int, action=DeprecatedAlias,
                    replacement="--matrix-approximation-rank", help=argparse.SUPPRESS)
    ap.add_argument("--start-iter", type=int, default=5, help="start_powerSGD_iter")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None, help="write/resume checkpoints here")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--stop-after", type=int, default=None, help="exit after this step (simulates an interruption)")
    ap.add_argument("--fail-at-step", type=int, default=None,
                    help="rank 1 raises at this step on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None, help="rank 0 saves the final parameters and a summary here")
    return ap.parse_args(argv)


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT),
    )


def batch(args, step, rank, device):
    """This rank's batch of this step: a function of (seed, step, rank) only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(args.batch_size, IN, generator=g)
    w = torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(args.batch_size, OUT, generator=g)
    return x.to(device), y.to(device)


def latest_checkpoint(folder):
    pointer = os.path.join(folder, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(folder, f.read().strip())


def save_checkpoint(args, step, ddp, optimizer, scheduler, state, rank):
    """Every rank writes its hook state; rank 0 writes the rest, then moves the ``latest`` pointer (atomically)."""
    name = f"step_{step:06d}"
    folder = os.path.join(args.checkpoint_dir, name)
    os.makedirs(folder, exist_ok=True)
    if state is not None:
        save_hook_state(state, ddp, folder)  # folder/hook_state.rank{rank}.pt
    if rank == 0:
        tmp = os.path.join(folder, "train.pt.tmp")
        torch.save({"step": step, "model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, tmp)
        os.replace(tmp, os.path.join(folder, "train.pt"))
    dist.barrier()  # every rank's files are written before the pointer moves
    if rank == 0:
        tmp = os.path.join(args.checkpoint_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(name)
        os.replace(tmp, os.path.join(args.checkpoint_dir, "latest"))
    dist.barrier()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu")
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # env:// from torchrun. torchrun shares its rendezvous store with the workers and keeps it across restarts: keys
    # left by the previous attempt (gloo's addresses, NCCL's unique id) would be read by the next one (pytorch/pytorch
    # #135712), so each attempt gets its own key prefix.
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"torchrun_ddp/attempt{attempt}", store)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=store, rank=rank, world_size=world)

    model = make_model(args.seed).to(device)
    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    if args.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.bucket_cap_mb
    ddp = DDP(model, **kwargs)
    state = None
    if args.hook != "allreduce":
        state = PowerSGDState(process_group=None, matrix_approximation_rank=args.matrix_approximation_rank,
                              start_powerSGD_iter=args.start_iter, random_seed=args.seed)
        hooks = {"powersgd": powerSGD_hook, "alternating": alternating_powerSGD_hook, "batched": batched_powerSGD_hook}
        register(ddp, state, hooks[args.hook])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))

    start = 0
    resumed_from = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if resumed_from is not None:
        ckpt = torch.load(os.path.join(resumed_from, "train.pt"), map_location=device, weights_only=True)
        ddp.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if state is not None:
            load_hook_state(state, ddp, resumed_from)  # this rank's file; checks world size and model
        start = ckpt["step"]
        if rank == 0:
            print(f"resumed from {resumed_from} at step {start} (attempt {attempt})", flush=True)

    t0 = time.perf_counter()
    done, last_loss = start, float("nan")
    for step in range(start, args.steps):
        if args.fail_at_step is not None and step == args.fail_at_step and attempt == 0 and rank == world - 1:
            raise RuntimeError(f"simulated failure of rank {rank} at step {step} (--fail-at-step)")
        x, y = batch(args, step, rank, device)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        done, last_loss = step + 1, loss.item()
        if args.checkpoint_dir and done % args.checkpoint_every == 0:
            save_checkpoint(args, done, ddp, optimizer, scheduler, state, rank)
        if args.stop_after is not None and done >= args.stop_after:
            if rank == 0:
                print(f"stopping after step {done} (--stop-after)", flush=True)
            break

    finished = args.stop_after is None or args.stop_after >= args.steps
    if rank == 0:
        stats = state.compression_stats() if state is not None else None
        loss_text = f"loss {last_loss:.4f}" if done > start else "nothing left to train (resumed at the last step)"
        print(f"step {done}/{args.steps} {loss_text} hook iter {state.iter if state else '-'} "
              f"compression {stats[0] if stats else 1:.1f}x {time.perf_counter() - t0:.1f}s", flush=True)
        if args.out and finished:
            torch.save({"params": {k: v.cpu() for k, v in ddp.module.state_dict().items()},
                        "steps": args.steps, "hook_iter": state.iter if state else None,
                        "compression_stats": list(stats) if stats else None, "resumed_from": resumed_from},
                       args.out)
    dist.barrier()
    del ddp, optimizer, scheduler, state
    # not torch's destroy: on gloo a rank can abort at exit after the job finished ("terminate called without an
    # active exception": a gloo worker thread still releasing a finished collective's Python objects as the
    # interpreter shuts down); ours returns once gloo's worker threads are idle (powersgd_triton.teardown)
    teardown.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
