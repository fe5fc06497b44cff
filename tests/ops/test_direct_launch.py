"""Launch plans and the direct launch of compiled kernels (powersgd_triton.ops.launch.DirectLaunch), on CPU with the
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
from powersgd_triton.compat.versions import c_launch_layout  # noqa: E402 - the version gate, in compat only

if c_launch_layout() is None:
    pytest.skip("DirectLaunch launches directly under the Tritons of compat.versions.DIRECT_LAUNCH_TRITON only "
                f"(3.6, 3.8, 3.9), not {triton.__version__}", allow_module_level=True)
LAYOUT_39 = c_launch_layout() == "v39"
needs_39_layout = pytest.mark.skipif(not LAYOUT_39, reason="the recorded launcher arguments are laid out as "
                                     "triton 3.8 and 3.9 pass them")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    from powersgd_triton import PowerSGDState, powerSGD_hook
    from powersgd_triton.ops import launch as _launch
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
        plain_call, plain_jit = _launch.DirectLaunch.__call__, _launch.DirectLaunch._jit

        def both(self, *args):
            _launch.DIRECT_LAUNCH = False
            plain_call(self, *args)
            _launch.DIRECT_LAUNCH = True
            n = len(jit_calls)
            plain_call(self, *args)
            jit_calls.append(len(jit_calls) - n)  # JIT calls made by the direct call: none expected

        def jit(self, args):
            jit_calls.append(None)
            return plain_jit(self, args)

        _launch.DirectLaunch.__call__, _launch.DirectLaunch._jit = both, jit
        step()
        _launch.DirectLaunch.__call__, _launch.DirectLaunch._jit = plain_call, plain_jit
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
        _launch.DIRECT_LAUNCH = False
        with count_triton_launches() as counted:
            step()
        out["counted_jit"] = counted["n"]
        _launch.DIRECT_LAUNCH = True
        # Python calls of one bucket step (deterministic), per compressed bucket, with the C no-op launch
        fake.utils.set_counting(False)
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


@needs_39_layout
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


@needs_39_layout
def test_python_calls_per_bucket_step_resnet50_rank4():
    """The host bench's deterministic count (``sys.setprofile`` "call" events) of one compressed bucket step of
    ``powerSGD_hook`` on ResNet-50's real buckets at rank 4 on the Triton launch path (driver stub, collectives
    stubbed): at most 75 Python calls per bucket, whatever the bucket's tensor count (main at 18fb3ec: 862-1215; at
    e58eb3f: 89-94; with the hook step's launch trust and prepare_bucket's one parameter comparison: 88-93; with the
    step plans of TritonSteps.plan_step, each launch bound once per memory, and the hook skeleton's fast paths:
    71-75)."""
    r = _run("resnet50", "1", "float32")
    assert len(r["calls"]) >= 4 and max(r["calls"]) <= 75, r["calls"]


FACTS_SCRIPT = textwrap.dedent(r"""
    import json, os
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    import triton
    import triton.language as tl
    from powersgd_triton.ops import launch as _launch
    from powersgd_triton.benchmarking import host
    from powersgd_triton.compat.versions import c_launch_layout

    @triton.jit
    def _axpy(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, a * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    out = {}
    with host.fake_gpu() as fake:
        jit_calls = []
        plain_jit = _launch.DirectLaunch._jit

        def jit(self, args):
            jit_calls.append(1)
            return plain_jit(self, args)

        _launch.DirectLaunch._jit = jit
        fake.utils.record = rec = []
        x, y = torch.randn(64), torch.randn(64)
        launch = _launch.DirectLaunch(_axpy, (4,), dict(BLOCK=16))

        def calls(*args):  # the JIT calls the launch made (a failed JIT call raises, counted as 10)
            before = len(jit_calls)
            try:
                launch(*args)
            except Exception:
                return 10 + len(jit_calls) - before
            return len(jit_calls) - before

        seq = [("first", calls(x, y, 64, 1.5)), ("same", calls(x, y, 64, 1.5)),
               ("other tensors, same facts", calls(torch.randn(64), torch.randn(64), 64, 1.5)),
               ("bfloat16 x", calls(x.bfloat16(), y, 64, 1.5)),
               ("unaligned y", calls(x, y[1:], 63, 1.5)),
               ("other n", calls(x, y, 63, 1.5)),
               ("int a", calls(x, y, 64, 1)),
               ("bool a", calls(x, y, 64, True)),
               ("a tensor for n", calls(x, y, torch.tensor(64), 1.5)),
               ("an int for x", calls(64, y, 64, 1.5)),
               ("fewer arguments", calls(x, y, 64)),
               ("back to the first", calls(x, y, 64, 1.5))]
        out["seq"] = seq
        # the kernel's arguments in the C launch's arguments: one tuple last (3.8, 3.9), or spread from the 14th (3.6)
        kernel_args = (lambda r: r[-1]) if c_launch_layout() == "v39" else (lambda r: r[13:])
        out["direct_args"] = [list(map(str, kernel_args(rec[1])))]
        out["first_args"] = [list(map(str, kernel_args(rec[0])))]
        # a first call with an unaligned tensor: direct again with the same facts (the kernel compiled for them),
        # the JIT call for an aligned one
        un = _launch.DirectLaunch(_axpy, (4,), dict(BLOCK=16))
        before = len(jit_calls)
        for _ in range(3):
            un(x[1:], y, 63, 1.5)
        out["unaligned_first"] = len(jit_calls) - before
        before = len(jit_calls)
        un(x[:63], y, 63, 1.5)
        out["then_aligned"] = len(jit_calls) - before
        out["launches"] = fake.utils.launches
    print("RESULT " + json.dumps(out))
""")


def test_direct_launch_takes_the_jit_path_when_a_specialization_fact_changes(tmp_path):
    """``DirectLaunch`` launches directly only when the call has the facts of the call it compiled for: the same
    argument count, tensors at the same positions with the same dtypes and 16-byte alignment, and the other arguments of
    the same type and value (Triton specializes on them). Any change is the JIT call (which compiles or picks the
    right kernel, and, when it fails, raises as usual), an unaligned tensor where an aligned one was and back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "facts.py"  # a file: @triton.jit reads the kernel's source
    script.write_text(FACTS_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    r = json.loads(line[-1][len("RESULT "):])
    seq = dict(r["seq"])
    assert seq.pop("first") == 1 and seq.pop("same") == 0 and seq.pop("other tensors, same facts") == 0
    assert seq.pop("back to the first") in (0, 1)  # direct again once the facts are the compiled call's
    # a tensor where an int was, an int where a tensor was, an argument missing: the JIT call, which raises
    assert {k: seq.pop(k) for k in ("a tensor for n", "an int for x", "fewer arguments")} == {
        "a tensor for n": 11, "an int for x": 11, "fewer arguments": 11}
    assert seq == {k: 1 for k in seq}, seq  # every other changed fact: the JIT call
    assert r["unaligned_first"] == 1 and r["then_aligned"] == 1
    # the direct launch passed the JIT call's kernel arguments (tensors, n, a; the constexpr BLOCK after them)
    assert r["direct_args"][0][2:] == r["first_args"][0][2:]
