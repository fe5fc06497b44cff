"""The hooks' step plans (powersgd_triton.ops.backend.TritonSteps.plan_step): a steady bucket step launches through
launches bound once per memory, and every launch and its arguments are those the step makes through the steps'
methods (the plans turned off by patching plan_step to return None). On CPU with the host benchmark's driver stub
(powersgd_triton.benchmarking.host.FakeDriver: the C launch records its arguments), in a subprocess without
TRITON_INTERPRET (the kernels compiled for sm_90, never run)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
from powersgd_triton.compat.versions import c_launch_layout  # noqa: E402 - the version gate, in compat only

if c_launch_layout() != "v39":
    pytest.skip("the recorded launcher arguments are laid out as triton 3.8 and 3.9 pass them", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
    from powersgd_triton.ops import backend
    from powersgd_triton.benchmarking import host
    from powersgd_triton.benchmarking.buckets import model_bucket_shapes
    from powersgd_triton.benchmarking.hooks import ensure_process_group

    ensure_process_group("gloo")
    torch.set_num_threads(1)
    dtype, batched, warm, feedback = getattr(torch, sys.argv[1]), *(a == "1" for a in sys.argv[2:5])
    hook = batched_powerSGD_hook if batched else powerSGD_hook
    out = {"plans": [], "methods": [], "pairs": 0, "mismatches": []}
    with host.fake_gpu() as fake, host.no_collectives():
        buckets = host._buckets(model_bucket_shapes("resnet50", dtype, shrink=8), dtype)
        state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                              backend="triton", verify="off", warm_start=warm, use_error_feedback=feedback)
        for _ in range(4):
            for b in buckets:
                hook(state, b).wait()
        plain_plan_step = backend.TritonSteps.plan_step
        methods = []
        for name in ("project", "orthogonalize", "project_t", "average", "reconstruct", "pack_uncompressed"):
            original = getattr(backend.TritonSteps, name)

            def counted(self, *a, __o=original, __n=name, **k):
                methods.append(__n)
                return __o(self, *a, **k)

            setattr(backend.TritonSteps, name, counted)
        plans = []

        def plan_step(self, tensors, settings):
            plan = plain_plan_step(self, tensors, settings)
            plans.append(plan)
            return plan

        for b in buckets:
            records = []
            for planned in (True, False):
                backend.TritonSteps.plan_step = plan_step if planned else (lambda self, t, s: None)
                fake.utils.record = rec = []
                methods.clear()
                n = len(plans)
                hook(state, b).wait()
                records.append(rec)
                if planned:
                    out["plans"].append(len(plans) - n)
                    out["methods"].append(list(methods))
            a_rec, b_rec = records
            mem = state.buckets.get(b.index())
            kept = {id(t) for t in (b.buffer(), mem.q, mem.q_work, mem.p, mem.p_work, mem.error, mem.p_comm,
                                    mem.q_comm) if t is not None}
            if len(a_rec) != len(b_rec):
                out["mismatches"].append(("count", len(a_rec), len(b_rec)))
                continue
            for a, c in zip(a_rec, b_rec):
                out["pairs"] += 1
                same = a[:8] == c[:8] and a[11:15] == c[11:15] and len(a[15]) == len(c[15])
                for x, y in zip(a[15], c[15]):
                    if isinstance(x, torch.Tensor):  # the memory's own tensors, or the step's fresh allocations
                        same = same and isinstance(y, torch.Tensor) and (x is y or (
                            id(x) not in kept and id(y) not in kept and x.dtype == y.dtype and x.shape == y.shape))
                    else:
                        same = same and type(x) is type(y) and x == y
                if not same:
                    out["mismatches"].append(str(a[4]))
        fake.utils.record = None
        backend.TritonSteps.plan_step = plain_plan_step
        # the plan is built once: a later step on the same memory finds it again
        again = []
        backend.TritonSteps.plan_step = lambda self, t, s: again.append(self.plan) or plain_plan_step(self, t, s)
        for b in buckets:
            hook(state, b).wait()
        out["kept"] = all(p is not None for p in again)
    print("RESULT " + json.dumps(out))
""")


def _run(*argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, argv)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("dtype, batched, warm, feedback", [
    ("float32", 0, 1, 1), ("bfloat16", 0, 1, 1), ("float32", 1, 1, 1), ("bfloat16", 1, 1, 1), ("float32", 0, 0, 1),
    ("bfloat16", 0, 1, 0), ("float32", 0, 0, 0)],
    ids=["fp32", "bf16", "batched", "batched-bf16", "no-warm-start", "bf16-no-error-feedback", "neither"])
def test_step_plan_launches_what_the_steps_methods_launch(dtype, batched, warm, feedback):
    """Per compressed bucket of ResNet-50 (shrunk 8x: 1 or 2 compressed buckets), one steady step through the memory's step plan and one with
    plans off: the same launches in the same order with the same grid, function, metadata and arguments (the
    memory's tensors the same objects, the step's fresh allocations — packed gradients, step flags — of the same
    dtype and shape; every other argument equal and of the same type); through the plan, no steps method is called
    but the next Q's ``orthogonalize`` (warm start); a plan per bucket, kept for the next step."""
    r = _run(dtype, batched, warm, feedback)
    assert len(r["plans"]) >= 1 and r["pairs"] >= 6 * len(r["plans"]) and r["mismatches"] == [], r
    assert r["plans"] and all(n == 1 for n in r["plans"]), r["plans"]
    assert all(m == (["orthogonalize"] if warm else []) for m in r["methods"]), r["methods"]
    assert r["kept"]
