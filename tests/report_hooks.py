"""Launches per step and memory per bucket on ResNet-50's gradients: our hook against PyTorch's.

Run: ``PYTHONPATH=.:tests OMP_NUM_THREADS=1 python tests/report_hooks.py [rank ...]`` (one gloo rank, CPU, ~1 min).
Not a test (pytest does not collect it). Counting rules in ``tests/_launches.py``.
"""

import sys
import tempfile

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from _dist import FakeBucket, bucket_numel, run_ranks
from _launches import CountLaunches, counting_bucket_kernels, synchronous_all_reduce
from _resnet50 import ddp_buckets, resnet50_shapes
from powersgd_triton import PowerSGDState, powerSGD_hook


def _mb(nbytes):
    return f"{nbytes / 2**20:8.2f}"


def _worker(rank, world_size, ranks):
    buckets = ddp_buckets(resnet50_shapes())
    n = len(buckets)
    lines = [f"ResNet-50: {len(resnet50_shapes())} gradients, {n} DDP buckets (25 MiB cap, 1 MiB first), fp32"]
    for r in ranks:
        ours = PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2, backend="torch")
        theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        counts = {}
        for name, state, hook in (("ours", ours, powerSGD_hook), ("pytorch", theirs, torch_psgd.powerSGD_hook)):
            for step in range(4):
                counter = CountLaunches()
                for i, shapes in enumerate(buckets):
                    bucket = FakeBucket(torch.randn(bucket_numel(shapes)), shapes, index=n - 1 - i, is_last=i == n - 1)
                    if step == 3:  # steady state: after 2 plain steps and the first compressed one
                        with counting_bucket_kernels(counter), synchronous_all_reduce(counter), counter:
                            hook(state, bucket).wait()
                    else:
                        hook(state, bucket).wait()
            counts[name] = counter
        o, t = counts["ours"], counts["pytorch"]
        lines.append(
            f"rank {r}: launches per step: ours {sum(o.kernels.values())} bucket kernels + {o.total_ops} other ops "
            f"= {sum(o.kernels.values()) + o.total_ops}; PyTorch {t.total_ops} ATen ops "
            f"({sum(v for k, v in t.ops.items() if 'qr' in k)} of them QR); all-reduces ours {o.all_reduces}, "
            f"PyTorch {t.all_reduces}"
        )
        lines.append(f"  ours, other ops: {dict(o.ops)}")
        lines.append(f"  PyTorch ops: {dict(t.ops.most_common())}")
        lines.append(
            "  bucket    numel   compressed  | PyTorch MiB: error   P+Q  clone+cat (per step) | "
            "ours MiB: error   P+Q+Qwork  gather (per step) | extra (ours - PyTorch), persistent / peak"
        )
        for i, shapes in enumerate(buckets):
            index = n - 1 - i
            mem = ours.buckets[index]
            lay = mem.layout
            elt = 4
            t_err = theirs.error_dict[index].numel() * elt
            t_pq = (theirs.p_memory_dict[index].numel() + theirs.q_memory_dict[index].numel()) * elt
            t_tmp = (lay.numel + lay.uncompressed_numel) * elt  # input clone + torch.cat of the uncompressed
            o_err = mem.error.numel() * elt
            o_pq = (mem.p.numel() + mem.q.numel() + mem.q_work.numel()) * elt
            o_tmp = lay.uncompressed_numel * elt if len(lay.uncompressed) > 1 else 0  # index_select gather
            lines.append(
                f"  {index:>6} {lay.numel:>9} {lay.num_matrices:>4}/{len(shapes):<4}    | {_mb(t_err)} {_mb(t_pq)} "
                f"{_mb(t_tmp)}            | {_mb(o_err)} {_mb(o_pq)} {_mb(o_tmp)}           | "
                f"{_mb(o_err + o_pq - t_err - t_pq)} / {_mb(o_err + o_pq + o_tmp - t_err - t_pq - t_tmp)}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    ranks = [int(a) for a in sys.argv[1:]] or [1, 4]
    print(run_ranks(_worker, 1, tempfile.mkdtemp(), ranks, timeout=600)[0])
