"""The hook step's launch trust (powersgd_triton.ops.launch.TRUST, powersgd_triton.hooks.driver.launch_trust): a
steady bucket step checks its tensors' specialization facts once, not per launch, and any change of those facts is
checked again. On CPU with the host benchmark's driver stub (powersgd_triton.benchmarking.host.FakeDriver), in a
subprocess without TRITON_INTERPRET (the kernels compiled for sm_90, never run)."""

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(r"""
    import json, os
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    import triton
    import triton.language as tl
    from powersgd_triton import PowerSGDState, powerSGD_hook
    from powersgd_triton.ops import launch as _launch
    from powersgd_triton.benchmarking import host
    from powersgd_triton.benchmarking.buckets import model_bucket_shapes
    from powersgd_triton.benchmarking.hooks import ensure_process_group

    @triton.jit
    def _axpy(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, a * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    ensure_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    with host.fake_gpu() as fake, host.no_collectives():
        jit_calls = []
        plain_jit = _launch.DirectLaunch._jit

        def jit(self, args):
            jit_calls.append(1)
            return plain_jit(self, args)

        _launch.DirectLaunch._jit = jit
        x, y = torch.randn(64), torch.randn(64)
        launch = _launch.DirectLaunch(_axpy, (4,), dict(BLOCK=16))

        def calls(key, *args):  # the JIT calls of one launch under TRUST key `key`
            before = len(jit_calls)
            _launch.TRUST.key = key
            try:
                launch(*args)
            finally:
                _launch.TRUST.key = None
            return len(jit_calls) - before

        k1, k2 = ("facts",), ("facts",)  # equal, but another object
        out["seq"] = [("first", calls(k1, x, y, 64, 1.5)), ("same", calls(k1, x, y, 64, 1.5)),
                      ("bfloat16 x, same key", calls(k1, x.bfloat16(), y, 64, 1.5)),
                      ("other n, same key", calls(k1, x, y, 63, 1.5)),
                      ("int a, same key", calls(k1, x, y, 64, 1)),
                      ("back", calls(k1, x, y, 64, 1.5)),
                      ("bfloat16 x, another key", calls(k2, x.bfloat16(), y, 64, 1.5)),
                      ("bfloat16 x, no key", calls(None, x.bfloat16(), y, 64, 1.5)),
                      ("unaligned y, no key", calls(None, x, y[1:], 63, 1.5))]
        out["thread_default"] = _launch.TRUST.key is None

        # the hook: the step's key is one object while its facts stay, a new one when a fact changes
        buckets = host._buckets(model_bucket_shapes("gpt2", torch.float32, shrink=8), torch.float32)
        state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                              backend="triton", verify="off")  # the stubbed kernels compute nothing to verify

        def step():
            before = len(jit_calls)
            for b in buckets:
                powerSGD_hook(state, b).wait()
            return len(jit_calls) - before

        for _ in range(4):  # warm-up, then compressed steps: every launch plan built, every kernel compiled
            step()
        mems = [state.buckets[b.index()] for b in buckets]
        keys = [m.steps.facts for m in mems]
        out["steady_jit"] = step()
        out["steady_same_keys"] = all(m.steps.facts is k for m, k in zip(mems, keys))
        out["keys"] = sum(k is not None for k in keys)
        out["key_after_step"] = _launch.TRUST.key is None
        # P and Q on the wire in bfloat16: project and project_t write them in it (another tensor, another dtype)
        state.communication_dtype = torch.bfloat16
        out["wire_jit"] = step()
        out["wire_new_keys"] = all(m.steps.facts is not k and m.steps.facts != k for m, k in zip(mems, keys))
        out["wire_steady_jit"] = step()
        # a launch hook set: every launch through the JIT path, the trust notwithstanding
        recorded = []
        triton.knobs.runtime.launch_enter_hook.add(lambda *a: recorded.append(1))
        out["hooked_jit"] = step()
    print("RESULT " + json.dumps(out))
""")


def test_launch_trust_skips_tensor_checks_only_under_the_key_that_checked_them(tmp_path):
    """Under a TRUST key, a launch plan that checked its tensors' facts under that very key object launches directly
    without checking them again (a bfloat16 tensor where a float32 one was is the caller's to vouch for), while its
    other arguments (ints are specialized on) are still compared; another key object, even an equal one, or no key
    checks every fact again. A hook step's key stays one object while its tensors' facts stay (steady steps: no JIT
    call), and becomes a new one when a fact changes (P and Q on the wire in bfloat16: the launches that take them
    are checked and compiled again); the key is cleared after the step; a launch hook takes every launch through
    the JIT path as before."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "trust.py"  # a file: @triton.jit reads the kernel's source
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    r = json.loads(line[-1][len("RESULT "):])
    assert dict(r["seq"]) == {"first": 1, "same": 0, "bfloat16 x, same key": 0, "other n, same key": 1,
                              "int a, same key": 1, "back": 1, "bfloat16 x, another key": 1,
                              "bfloat16 x, no key": 0, "unaligned y, no key": 1}, r["seq"]
    assert r["thread_default"] and r["key_after_step"]
    assert r["keys"] >= 2 and r["steady_same_keys"] and r["steady_jit"] == 0
    assert r["wire_new_keys"] and r["wire_jit"] >= 2 and r["wire_steady_jit"] == 0
    assert r["hooked_jit"] >= 7 * r["keys"]  # every launch of a step (7: the pack inside project's launch)
