"""Launch plans and the direct launch of compiled kernels (powersgd_triton._compat.DirectLaunch), on CPU with the
host benchmark's driver stub (powersgd_triton.benchmarking.host.FakeDriver: Triton's Python runs, the C launch
records its arguments instead of launching). A subprocess without TRITON_INTERPRET: the kernels are compiled for
sm_90 (once; Triton's disk cache), never run."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
if not triton.__version__.startswith(("3.8", "3.9")):
    pytest.skip("the recorded launcher arguments are laid out as triton 3.8 and 3.9 pass them", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    from powersgd_triton import _compat, PowerSGDState, powerSGD_hook
    from powersgd_triton.benchmarking import count_triton_launches, host
    from powersgd_triton.benchmarking.buckets import model_bucket_shapes
    from powersgd_triton.benchmarking.hooks import ensure_process_group

    ensure_process_group("gloo")
    torch.set_num_threads(1)
    model, shrink, dtype = sys.argv[1], int(sys.argv[2]), getattr(torch, sys.argv[3])
    out = {}
    with host.fake_gpu() as fake, host.no_collectives():
        buckets = host._buckets(model_bucket_shapes(model, dtype, shrink=shrink), dtype)
        state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                              backend="triton", verify="off")  # the stubbed kernels compute nothing to verify

        def step():
            for b in buckets:
                powerSGD_hook(state, b).wait()

        for _ in range(4):  # warm-up, then compressed steps: every launch plan built, every kernel compiled
            step()
        # each launch twice with the same arguments: the JIT call (DIRECT_LAUNCH off), then the direct one
        fake.utils.record = rec = []
        jit_calls = []
        plain_call, plain_jit = _compat.DirectLaunch.__call__, _compat.DirectLaunch._jit

        def both(self, *args):
            _compat.DIRECT_LAUNCH = False
            plain_call(self, *args)
            _compat.DIRECT_LAUNCH = True
            n = len(jit_calls)
            plain_call(self, *args)
            jit_calls.append(len(jit_calls) - n)  # JIT calls made by the direct call: none expected

        def jit(self, args):
            jit_calls.append(None)
            return plain_jit(self, args)

        _compat.DirectLaunch.__call__, _compat.DirectLaunch._jit = both, jit
        step()
        _compat.DirectLaunch.__call__, _compat.DirectLaunch._jit = plain_call, plain_jit
        fake.utils.record = None
        pairs, mismatches = len(rec) // 2, []
        for i in range(pairs):
            a, b = rec[2 * i], rec[2 * i + 1]
            # (grid x, y, z, stream, function, cooperative, pdl, packed metadata, launch metadata, enter hook,
            #  exit hook, global scratch, profile scratch, annotations, signature, kernel arguments)
            same = a[:8] == b[:8] and a[11:15] == b[11:15] and len(a[15]) == len(b[15]) and all(
                x is y or (not isinstance(x, torch.Tensor) and type(x) is type(y) and x == y)
                for x, y in zip(a[15], b[15]))
            hooks_idle = not a[9].calls and not a[10].calls and b[8:11] == (None, None, None)
            if not (same and hooks_idle):
                mismatches.append(i)
        out.update(pairs=pairs, mismatches=mismatches, direct_jit_calls=sum(c or 0 for c in jit_calls),
                   launch_args=max(len(r[15]) for r in rec))
        # a launch counter (it replaces JITFunction.run) sees every launch: the direct path steps aside for it
        before = fake.utils.launches
        with count_triton_launches() as counted:
            step()
        out.update(counted=counted["n"], launched=fake.utils.launches - before)
        # and DIRECT_LAUNCH = False: every launch through JITFunction.run
        _compat.DIRECT_LAUNCH = False
        with count_triton_launches() as counted:
            step()
        out["counted_jit"] = counted["n"]
        _compat.DIRECT_LAUNCH = True
        # Python calls of one bucket step (deterministic), per compressed bucket
        calls = [host.python_calls(lambda b=b: powerSGD_hook(state, b).wait()) for b in buckets]
        out["calls"] = calls
    print("RESULT " + json.dumps(out))
""")


def _run(*argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_direct_launch_passes_what_the_jit_path_binds(dtype):
    """Every launch of a steady hook step, made once through ``JITFunction.run`` and once through the launch plan's
    direct call with the same arguments: the compiled kernel receives the same grid, stream, function, packed
    metadata and arguments (constexprs included, in parameter order), with no launch hooks set (the JIT path passes
    empty hook chains and a launch metadata object, the direct one None); the direct calls make no JIT call. A launch
    counter (it replaces ``JITFunction.run``) and ``DIRECT_LAUNCH = False`` see every launch through the JIT path."""
    r = _run("resnet50", "8", dtype)
    assert r["pairs"] >= 7 and r["mismatches"] == []
    assert r["direct_jit_calls"] == 0
    assert r["launch_args"] >= 10
    assert r["counted"] == r["launched"] == r["pairs"] == r["counted_jit"]


def test_python_calls_per_bucket_step_resnet50_rank4():
    """The host bench's deterministic count (``sys.setprofile`` "call" events) of one compressed bucket step of
    ``powerSGD_hook`` on ResNet-50's real buckets at rank 4 on the Triton launch path (driver stub, collectives
    stubbed): at most 150 Python calls per bucket, whatever the bucket's tensor count (main at 18fb3ec: 862-1215)."""
    r = _run("resnet50", "1", "float32")
    assert len(r["calls"]) >= 4 and max(r["calls"]) <= 150, r["calls"]
