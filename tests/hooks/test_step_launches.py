"""Device work of one compressed step on a 161-gradient (ResNet-50-shaped) bucket, Triton backend: at most 7 device
ops besides the collectives (Triton launches plus every other ATen op that touches data), for the standard,
batched and alternating hooks. Counted with the interpreter's launch hook without running the kernels (the count does
not depend on the numbers: the hooks never read device values on the host)."""

import pytest
import torch

from powersgd_triton import PowerSGDState, alternating_powerSGD_hook, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton import benchmarking as B
from powersgd_triton.shapes import model_shapes

pytest.importorskip("triton")

HOOKS = {"powerSGD": powerSGD_hook, "batched": batched_powerSGD_hook, "alternating": alternating_powerSGD_hook}


def _bucket(rng):
    shapes = B.shrink_shapes(model_shapes("resnet50"), 8)  # the 161 gradients, channel dims / 8: interpreter-sized
    assert len(shapes) == 161
    n = sum(torch.Size(s).numel() for s in shapes)
    return B.FakeGradBucket(torch.randn(n, generator=rng), shapes)


@pytest.mark.parametrize("hook", list(HOOKS))
@pytest.mark.parametrize("error_feedback", [True, False], ids=["ef", "no-ef"])
def test_device_ops_per_compressed_step(hook, error_feedback, rng, world1, monkeypatch):
    from powersgd_triton.ops import launch

    # plan as on an H100/H200 (132 SMs: project_t splits tall matrices, a second launch); nothing is executed
    monkeypatch.setattr(launch, "DEFAULT_NUM_SMS", 132)
    bucket = _bucket(rng)
    state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2, backend="triton",
                          use_error_feedback=error_feedback, verify="off")  # kernels not run: nothing to verify
    fn = HOOKS[hook]
    with B.count_triton_launches(execute=False):
        for _ in range(4):  # 2 plain steps, the first compressed step (draws Q), one more (the other half-step)
            fn(state, bucket).wait()
    counts = []
    for _ in range(2):  # both half-steps of the alternating hook
        c = B.count_step(lambda: fn(state, bucket).wait(), triton_execute=False)
        counts.append(c)
        print(f"{hook} ef={error_feedback}: {c.triton_launches} Triton launches {c.triton_by_kernel}, "
              f"{c.aten_compute} other device ops {dict((k, v) for k, v in c.by_op.items() if 'c10d' not in k)}, "
              f"{c.allreduce_calls} all-reduces")
    for c in counts:
        assert c.triton_launches + c.aten_compute <= 7, (c.triton_by_kernel, c.by_op)
        if hook == "powerSGD":  # the biases lie in several ranges: packed by project's launch, no launch of its own
            assert "_copy_segments_kernel" not in c.triton_by_kernel, c.triton_by_kernel
        assert c.allreduce_calls == (1 if hook == "alternating" else 3 if hook == "powerSGD" else 2)
