"""P and Q in the communication dtype, written and read by the kernels (the layer-wise and batched hooks on the
Triton backend, fp16/bf16 buckets and ``communication_dtype``): ``project`` and ``project_t`` store them rounded to
nearest even into the buffers they are all-reduced in, P is copied back into float32 for ``orthogonalize``,
``average`` divides Q from its buffer into the float32 ``q_work``; no cast before the all-reduces, one copy after.

Oracle: the same hook on the same Triton kernels with ``OPTIONS.wire_in_kernels = False`` (:class:`powersgd_triton.hooks.driver.HookOptions`) (float32 factors, cast to
the communication dtype before each all-reduce and copied back after it, as the torch backend does), on 3 gloo
ranks with different gradients (the world size 3 makes the division by it inexact), under the interpreter: every
step's output and memory (error, P, Q) equal bitwise, an fp16 overflow step included (non-finite there, the memory
kept). The all-reduced tensors are the memory's own ``p_comm`` / ``q_comm`` in the communication dtype.
"""

import pytest
import torch
import torch.distributed as dist

from _dist import FakeBucket, run_ranks

pytestmark = pytest.mark.timeout(600)

SHAPES = [(48, 40), (24,), (72, 24), (17, 23), (8,)]
SCALES = [1.0, 10.0, 100.0, 1.0, 3e4, 1.0]  # 3e4: fp16 P and Q overflow to inf (a non-finite step)
CASES = [("powerSGD_hook", "bfloat16", None), ("powerSGD_hook", "float16", None),
         ("powerSGD_hook", "float32", "bfloat16"), ("batched_powerSGD_hook", "bfloat16", None),
         ("batched_powerSGD_hook", "float16", None)]


def _worker(rank, world_size):
    import powersgd_triton
    from powersgd_triton import PowerSGDState
    from powersgd_triton.hooks.driver import OPTIONS

    numel = sum(torch.Size(s).numel() for s in SHAPES)
    sent = []
    plain = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sent.append(tensor)
        return plain(tensor, *args, **kwargs)

    dist.all_reduce = recording
    out = {}
    try:
        for hook_name, dname, comm in CASES:
            hook = getattr(powersgd_triton, hook_name)
            dtype = getattr(torch, dname)
            wire = getattr(torch, comm) if comm else dtype
            runs = {}
            for fused in (True, False):
                OPTIONS.wire_in_kernels = fused
                state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                      backend="triton", verify="off",
                                      **({"communication_dtype": wire} if comm else {}))
                gen = torch.Generator().manual_seed(1000 * rank + 7)
                steps, factors = [], []
                for scale in SCALES:
                    buf = (torch.randn(numel, generator=gen) * scale).to(dtype)
                    sent.clear()
                    result = hook(state, FakeBucket(buf, SHAPES)).wait()
                    mem = state.buckets.get(0)  # none during the warm-up
                    kept = [] if mem is None else [mem.error.double(), mem.p.double(), mem.q.double()]
                    steps.append(torch.cat([result.double()] + kept))
                    factors.append([] if mem is None else
                                   [(t.dtype, t is mem.p_comm or t is mem.q_comm) for t in sent[-2:]])
                runs[fused] = (steps, factors)
            (a, fa), (b, _) = runs[True], runs[False]
            same = all(torch.equal(x.nan_to_num(1.5, 2.5, 3.5), y.nan_to_num(1.5, 2.5, 3.5)) for x, y in zip(a, b))
            nonfinite = [int((~row.isfinite()).sum()) for row in a]
            compressed = [f for f in fa[2:]]  # after the two warm-up steps: P and Q are the last two all-reduces
            out[f"{hook_name} {dname} {comm}"] = dict(same=same, nonfinite=nonfinite, factors=[
                [(str(d), own) for d, own in f] for f in compressed], wire=str(wire))
    finally:
        dist.all_reduce = plain
        OPTIONS.wire_in_kernels = True
    return out


def test_factors_in_the_communication_dtype_equal_the_cast_and_copy_path(tmp_path):
    results = run_ranks(_worker, 3, tmp_path, timeout=400)
    for rank, out in enumerate(results):
        assert set(out) == {f"{h} {d} {c}" for h, d, c in CASES}
        for name, r in out.items():
            assert r["same"], (rank, name)
            # the all-reduced P and Q of every compressed step: the memory's own buffers, in the communication dtype
            assert all(f == [(r["wire"], True), (r["wire"], True)] for f in r["factors"]), (rank, name, r["factors"])
            if name.split()[1] == "float16":  # the 3e4 step overflowed on the wire: non-finite, in both paths
                assert r["nonfinite"][4] > 0 and r["nonfinite"][5] == 0, (name, r["nonfinite"])
            else:
                assert not any(r["nonfinite"]), (name, r["nonfinite"])
