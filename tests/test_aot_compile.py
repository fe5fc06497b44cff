"""Every kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100/H200) on this CPU-only machine.

The interpreter accepts code the GPU compiler rejects (dot sizes, shared memory, types), so each kernel, in every
feature variant and gradient dtype (rank 4) and at ranks 1 and 32 (bfloat16), with its heuristic config, is compiled to a cubin here.
Each compile is ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` through
``triton_ops.compile_aot``. The autotuner's candidate configs are compiled by tests/test_autotune_aot.py. Runs in a subprocess: under
TRITON_INTERPRET=1 the kernels are interpreted functions.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from concurrent.futures import ProcessPoolExecutor
    import torch
    from powersgd_triton.kernels import triton_ops as T

    class _Layout:
        def __init__(self, r):
            self.max_rank = r

    def job(args):
        kernel, dtype_name, rank, variant, arch = args
        dtype = getattr(torch, dtype_name)
        cfg = T.heuristic_config(kernel, _Layout(rank), dtype) if kernel in T.KERNELS else {}
        try:
            c = T.compile_aot(kernel, cfg, dtype, rank, arch, variant)
            return dict(ok=True, kernel=kernel, dtype=dtype_name, rank=rank, arch=arch, shared=c.metadata.shared)
        except Exception as e:
            return dict(ok=False, kernel=kernel, dtype=dtype_name, rank=rank, arch=arch, variant=variant,
                        config=cfg, error=repr(e)[:2000])

    # every dtype at rank 4; the rank extremes (1: smallest tiles, 32: tl.dot path) in bfloat16
    cases = [("float32", 4), ("float16", 4), ("bfloat16", 4), ("bfloat16", 1), ("bfloat16", 32)]
    jobs = [(k, d, r, v, a) for k in T.KERNELS for d, r in cases for v in T.variants(k) for a in (80, 90)]
    jobs += [("copy_segments", d, 4, v, a) for d in ("float32", "bfloat16") for v in T.variants("copy_segments")
             for a in (80, 90)]
    jobs += [("commit_factor", "float32", 4, v, a) for v in T.variants("commit_factor") for a in (80, 90)]
    if __name__ == "__main__":
        with ProcessPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(job, jobs))
        json.dump(results, sys.stdout)
    """
)


@pytest.mark.timeout(900)
def test_heuristic_configs_compile_for_sm80_and_sm90(tmp_path):
    script = tmp_path / "aot.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=880)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout)
    failures = [r for r in results if not r["ok"]]
    assert not failures, json.dumps(failures[:5], indent=1)
    assert len(results) >= 4 * 5 * 2
    assert {r["arch"] for r in results} == {80, 90}
    # shared memory must fit an A100 (164 KiB) and an H100/H200 (228 KiB) block
    assert max(r["shared"] for r in results) <= 164 * 1024
