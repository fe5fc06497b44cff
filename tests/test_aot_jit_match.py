"""The compile table compiles what Triton's JIT compiles on a GPU (issue 39 item 5).

On a GPU, Triton's JIT specializes each launch on its arguments: a pointer whose tensor is 16-byte aligned is marked
``tt.divisibility = 16``, an integer divisible by 16 too, an integer equal to 1 becomes a constant; the compiler then
vectorizes, drops masks, and allocates registers differently (triton 3.6's orthogonalize at rank 4 spilled 1,840 bytes
with those attributes and none without). Here the hooks' real launches run through Triton's own JIT path against a
driver stub for sm_90 (``powersgd_triton.benchmarking.host.fake_gpu``: binding, specialization and compile run, the C
launch does nothing), each launch is recorded with the binary the JIT compiled (``tools.jit_launches``), and for each
one the compile table's job (``tools.aot_compile.table_jobs``) compiled ahead of time with the launch's argument facts
must give the same PTX. A launch the table has no job for fails too (the table would miss a launched binary).
Layouts: an aligned bucket (every matrix starts at and spans multiples of 16 bytes) and a ragged one (odd shapes, 1-D
gradients between matrices); both with 1-D gradients in two ranges (project's launch packs them). A fresh interpreter per run (TRITON_INTERPRET unset); kernels compiled, never run.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
from powersgd_triton.compat.versions import c_launch_layout  # noqa: E402 - the version gate, in compat only

if c_launch_layout() is None:
    pytest.skip("the fake GPU driver stands in for Triton 3.6, 3.8 and 3.9's launcher only, not "
                f"{triton.__version__}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    torch.set_num_threads(1)
    from powersgd_triton.benchmarking.hooks import ensure_process_group
    from tools import aot_compile, jit_launches

    ensure_process_group("gloo")
    which = sys.argv[1]
    # aligned: every matrix and 1-D gradient a multiple of 8 elements (16 bytes in bf16 and fp32); ragged: odd sizes
    ALIGNED = [(64, 32, 3, 3), (64,), (128, 64), (96, 40), (96,)]
    RAGGED = [(100, 37), (37,), (250, 129), (5,), (64, 33, 3, 3)]
    if which == "quick":  # one bucket step's launches of the two layouts, fp32, the layer-wise hook
        cases = [("powerSGD", torch.float32, [ALIGNED, RAGGED])]
    else:
        cases = [(hook, dtype, [ALIGNED, RAGGED]) for hook in ("powerSGD", "batched")
                 for dtype in (torch.float32, torch.bfloat16)]
    jobs = aot_compile.table_jobs()
    rows = []
    for hook, dtype, shapes in cases:
        for b in jit_launches.hook_step_launches(None, 4, dtype, shapes=shapes, hook=hook):
            for launch in b["launches"]:
                job = jit_launches.table_job_for(launch, jobs)
                row = dict(hook=hook, dtype=str(dtype)[6:], bucket=b["index"], kernel=launch["kernel"],
                           constexprs={k: str(v) for k, v in launch["constexprs"].items()},
                           aligned=sorted(k for k, v in launch["args"].items() if isinstance(v, tuple) and v[2]),
                           unaligned=sorted(k for k, v in launch["args"].items() if isinstance(v, tuple)
                                            and not v[2]),
                           job=job is not None)
                if job is not None:
                    aot = jit_launches.compile_like(launch, job)
                    row["same_ptx"] = jit_launches.ptx_body(aot) == jit_launches.ptx_body(launch["compiled"])
                rows.append(row)
    print("RESULT " + json.dumps(rows))
""")


def _run(which):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, which], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _check(rows):
    assert rows, "no launch recorded"
    missing = [r for r in rows if not r["job"]]
    assert not missing, "launches the compile table has no job for:\n" + "\n".join(map(str, missing))
    differ = [r for r in rows if not r["same_ptx"]]
    assert not differ, "compiled ahead of time unlike the JIT:\n" + "\n".join(map(str, differ))
    # the hooks pass allocations of their own (bucket, factors, error memory, tables): every pointer aligned, so the
    # table's default (aligned=True) is what they launch
    assert all(not r["unaligned"] for r in rows), [r for r in rows if r["unaligned"]]


@pytest.mark.timeout(900)
def test_compile_table_compiles_the_jits_binaries_layerwise_fp32():
    """One compressed step of ``powerSGD_hook`` at rank 4 in float32 on an aligned and a ragged bucket: every launch
    (project with the pack of the uncompressed gradients, orthogonalize, project_t and its reducer, average,
    reconstruct) is a compile-table job whose ahead-of-time binary is the JIT's, PTX for PTX."""
    rows = _run("quick")
    assert {r["kernel"] for r in rows} >= {"project", "orthogonalize", "project_t", "average",
                                           "reconstruct"}, rows
    # both buckets' biases lie in two ranges: packed by project's launch (aligned chunks, ragged ones)
    packs = sorted(r["constexprs"].get("PACK_ALIGN") for r in rows if r["kernel"] == "project")
    assert packs == ["0", "8"] and "copy_segments" not in {r["kernel"] for r in rows}, rows
    _check(rows)


@pytest.mark.slow  # ~4 hook configurations x ~8 binaries compiled twice: minutes on 2 cores
@pytest.mark.timeout(2400)
def test_compile_table_compiles_the_jits_binaries_every_hook_and_dtype():
    """The same for ``powerSGD_hook`` and ``batched_powerSGD_hook`` in float32 and bfloat16 (bfloat16: P and Q and
    the packed uncompressed gradients in the bucket's dtype on the wire)."""
    rows = _run("all")
    assert {(r["hook"], r["dtype"]) for r in rows} == {(h, d) for h in ("powerSGD", "batched")
                                                       for d in ("float32", "bfloat16")}
    _check(rows)
