"""The real C launch path, on CPU: Triton's own NVIDIA launcher compiled with the CPU C compiler against a stub
``libcuda.so.1`` (``tests/_stub_libcuda.c``, built here with gcc against the ``cuda.h`` Triton ships) whose
``cuLaunchKernelEx`` records each launch: function, grid, block, shared memory, stream, attributes and every kernel
parameter's bytes. The hooks' real launch plans (ResNet-50 buckets shrunk 8x: ``powerSGD_hook`` fp32 and bf16,
``batched_powerSGD_hook`` fp32, fp32 with P and Q in bf16 on the wire) launch each kernel twice with the same
arguments, through ``JITFunction.run`` and through :class:`powersgd_triton.ops.launch.DirectLaunch`'s direct C call:
byte for byte the same launch, and with the direct call's first two arguments swapped, a different one (the check
can fail). A fresh interpreter per run (``tests/_real_launcher.py``: TRITON_INTERPRET unset, the stub first on
LD_LIBRARY_PATH); kernels compiled for sm_90 (Triton's disk cache), never run.

Under every Triton with a direct launch (3.6, 3.8, 3.9: the main tier's and the compat tier's); skipped, with the
reason, without a C compiler or ``cuda.h``.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
from powersgd_triton.compat.versions import c_launch_layout  # noqa: E402 - the version gate, in compat only

if c_launch_layout() is None:
    pytest.skip("DirectLaunch launches directly under the Tritons of compat.versions.DIRECT_LAUNCH_TRITON only "
                f"(3.6, 3.8, 3.9), not {triton.__version__}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests")
CUDA_INCLUDE = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
CC = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
LAUNCHER = "triton.backends.nvidia.driver.CudaLauncher"


def _stub(tmp_path) -> str:
    """The stub libcuda.so.1 (and libcuda.so for the launcher's -lcuda) in a fresh folder; returns the folder."""
    if not CC:
        pytest.skip("no C compiler (gcc or cc; CC) to build Triton's launcher and the stub libcuda")
    if not os.path.exists(os.path.join(CUDA_INCLUDE, "cuda.h")):
        pytest.skip(f"triton {triton.__version__} ships no cuda.h in {CUDA_INCLUDE}")
    out = tmp_path / "stub"
    out.mkdir()
    subprocess.run([CC, "-shared", "-fPIC", "-O1", "-I", CUDA_INCLUDE, "-Wl,-soname,libcuda.so.1", "-o",
                    str(out / "libcuda.so.1"), os.path.join(HERE, "_stub_libcuda.c")], check=True,
                   capture_output=True, text=True)
    os.symlink("libcuda.so.1", out / "libcuda.so")
    return str(out)


def _run(stub_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["LD_LIBRARY_PATH"] = stub_dir + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    env["TRITON_LIBCUDA_PATH"] = stub_dir  # where Triton links its launcher modules (-lcuda)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_real_launcher.py"), stub_dir], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, (proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(line[-1][len("RESULT "):])


def test_direct_c_launch_is_the_jit_launch_byte_for_byte(tmp_path):
    """Every launch of a steady step of each case reaches ``cuLaunchKernelEx`` twice, through Triton's
    ``JITFunction.run`` / ``CudaLauncher.__call__`` / C ``launch`` and through ``DirectLaunch``'s call of that C
    ``launch``: the same function, grid, block, shared memory, stream (the driver's current one, which changes from
    one step to the next: three steps on three streams, and a direct path pinned to its first stream fails), attributes and
    parameter bytes; every direct launch took the C entry; with the direct call's first two kernel arguments swapped
    most launches differ (each whose first two arguments differ)."""
    r = _run(_stub(tmp_path))
    assert r["launcher"] == [LAUNCHER], r["launcher"]
    assert r["kernels"] >= 5 and r["stub_launches"] > 0
    for name, case in r["cases"].items():
        plain, swapped = case["plain"], case["swapped"]
        assert plain["records"] == 2 * plain["pairs"] and plain["pairs"] >= 7, (name, plain)
        assert plain["unregistered"] == 0 and plain["streams"] == ["5eed5", "5eed7", "c0ffee"], (name, plain)
        assert plain["direct_c_calls"] == plain["pairs"], (name, plain)  # the C entry, not kernel.run
        assert plain["mismatches"] == 0, (name, plain["first_mismatch"])
        # the swapped run: one step (on the first stream), a third of the plain run's three
        assert 3 * swapped["records"] == 6 * swapped["pairs"] == plain["records"], (name, swapped)
        assert swapped["mismatches"] >= max(1, swapped["pairs"] // 2), (name, swapped)
        # a direct path that kept each launch plan's first stream (DirectLaunch.stream pinned; the plans' first
        # launches of this run are on the first stream): every launch of the second and third steps differs
        stale = case["stale"]
        assert stale["records"] == plain["records"] and stale["mismatches"] == 2 * stale["pairs"] // 3, (name, stale)
