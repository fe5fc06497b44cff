"""Run by tests/ops/test_real_launcher.py in a fresh interpreter (TRITON_INTERPRET unset, the stub libcuda.so.1 first on
LD_LIBRARY_PATH and as TRITON_LIBCUDA_PATH): the hooks' real launch plans through Triton's real NVIDIA launcher.

Triton's driver module (``driver.c``) and launcher (3.6: the C generated per signature; 3.8/3.9: ``driver.c``'s
``launch``) are compiled by Triton itself with the CPU C compiler and linked against the stub, whose
``cuLaunchKernelEx`` records every launch (function, grid, block, shared memory, stream, attributes, every parameter's
bytes). The kernels are compiled for sm_90 (Triton's disk cache), never run. Each launch of a steady hook step is made
twice with the same arguments: through ``JITFunction.run`` (``DIRECT_LAUNCH`` off), then through the launch plan's
direct C call; the two records must be equal byte for byte. Then the same with the direct call's first two kernel
arguments swapped (the mutation the comparison must catch). Prints ``RESULT {json}``.

Usage: python tests/_real_launcher.py STUB_DIR
"""

import ctypes
import json
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from powersgd_triton import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from powersgd_triton.compat import versions as _compat  # noqa: E402
from powersgd_triton.compat.versions import c_launch_layout  # noqa: E402
from powersgd_triton.ops import launch as _launch  # noqa: E402
from powersgd_triton.benchmarking import host  # noqa: E402
from powersgd_triton.benchmarking.buckets import model_bucket_shapes  # noqa: E402
from powersgd_triton.benchmarking.hooks import ensure_process_group  # noqa: E402

STREAM = 0x5EED5  # the current stream both paths must pass (not 0: a dropped stream shows)
# the current stream changes between the steps of the plain run: a launch path that kept the stream of its first
# launch instead of asking for the current one at every launch sends later launches to the first stream
STREAMS = (STREAM, 0x5EED7, 0xC0FFEE)
V36 = c_launch_layout() == "v36"
# bytes of each kernel parameter as the launcher stores it (3.6: the generated C's argument types, i1 as int8_t;
# 3.8/3.9: driver.c's extractors, i1 as int32), pointers 8; two scratch pointers follow the kernel's parameters
SIZES = {"i1": 1 if V36 else 4, "u1": 1 if V36 else 4, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4,
         "i64": 8, "u64": 8, "fp16": 2, "bf16": 2, "fp32": 4, "f32": 4, "fp64": 8}


def param_sizes(signature) -> list:
    out = []

    def walk(ty):
        if isinstance(ty, tuple):
            for t in ty:
                walk(t)
        elif ty != "constexpr":
            out.append(8 if ty.startswith("*") else SIZES[ty])

    for ty in signature.values():
        walk(ty)
    return out + [8, 8]


def compiled_kernels():
    """Every kernel Triton compiled (or loaded) in this process for our kernel functions."""
    from powersgd_triton.ops import kernels as _kernels

    out = []
    for fn in _kernels.KERNEL_FUNCTIONS.values():
        jit = fn if hasattr(fn, "device_caches") else getattr(fn, "fn", None)
        for caches in getattr(jit, "device_caches", {}).values():
            out += [k for k in caches[0].values() if hasattr(k, "function")]
    return out


def main(stub_dir):
    from triton.backends.nvidia.driver import CudaLauncher, CudaUtils

    stub = ctypes.CDLL(os.path.join(stub_dir, "libcuda.so.1"))  # the one the launcher modules loaded (same soname)
    stub.psgd_stub_log_size.restype = ctypes.c_size_t
    stub.psgd_stub_log.restype = ctypes.c_size_t
    stub.psgd_stub_log.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    stub.psgd_stub_set_params.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    stub.psgd_stub_launches.restype = ctypes.c_long

    def take_log():
        n = stub.psgd_stub_log_size()
        buf = ctypes.create_string_buffer(n + 1)
        got = stub.psgd_stub_log(buf, n + 1)
        return buf.raw[:got].decode().splitlines()

    ensure_process_group("gloo")
    torch.set_num_threads(1)
    out = {"triton": triton.__version__}
    # the C entry of the direct path, counted (and mutated on demand): wraps this Triton's entry in _C_LAUNCH
    key = (_compat.triton_version() or ())[:2]
    entry = _compat._C_LAUNCH[key]
    used = {"calls": 0, "swap": False}

    def counted(launcher, g, stream, function, packed, args):
        used["calls"] += 1
        if used["swap"]:
            args = (args[1], args[0]) + tuple(args[2:])
        return entry(launcher, g, stream, function, packed, args)

    _compat._C_LAUNCH[key] = counted
    with host.fake_gpu() as fake, host.no_collectives():
        # the real driver module and launcher (C, compiled by Triton against the stub libcuda), the rest of the fake
        fake.utils = CudaUtils()
        fake.launcher_cls = CudaLauncher
        current = {"stream": STREAM}
        fake.get_current_stream = lambda device=None: current["stream"]
        cases = []
        for hook, dtype, comm in ((powerSGD_hook, torch.float32, None), (powerSGD_hook, torch.bfloat16, None),
                                  (batched_powerSGD_hook, torch.float32, None),
                                  (powerSGD_hook, torch.float32, torch.bfloat16)):
            buckets = host._buckets(model_bucket_shapes("resnet50", dtype, shrink=8), dtype)
            kw = {} if comm is None else {"communication_dtype": comm}
            state = PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                  backend="triton", verify="off", **kw)  # the kernels compute nothing to verify
            cases.append((f"{hook.__name__} {str(dtype)[6:]}" + (f" wire {str(comm)[6:]}" if comm else ""),
                          hook, state, buckets))

        def step(hook, state, buckets):
            for b in buckets:
                hook(state, b).wait()

        for _, hook, state, buckets in cases:
            for _ in range(4):  # warm-up, then compressed steps: every launch plan built, every kernel compiled
                step(hook, state, buckets)
        kernels = compiled_kernels()
        for k in kernels:  # the stub copies each parameter's bytes: it needs their sizes per function
            sizes = param_sizes(k.src.signature)
            stub.psgd_stub_set_params(ctypes.c_void_p(int(k.function)), len(sizes),
                                      (ctypes.c_int * len(sizes))(*sizes))
        out["kernels"] = len(kernels)
        out["launcher"] = sorted({type(k.run).__module__ + "." + type(k.run).__name__ for k in kernels})
        take_log()

        plain_call = _launch.DirectLaunch.__call__

        stale = {"on": False, "first": {}}

        def both(self, *args):  # each launch twice with the same arguments: the JIT call, then the direct one
            _launch.DIRECT_LAUNCH = False
            plain_call(self, *args)
            _launch.DIRECT_LAUNCH = True
            if stale["on"] and self.kernel is not None:  # a direct path that kept the stream of its first launch
                kept = stale["first"].setdefault(id(self), current["stream"])
                ask, self.stream = self.stream, (lambda device=None: kept)
                try:
                    plain_call(self, *args)
                finally:
                    self.stream = ask
                return
            plain_call(self, *args)

        results = {}
        for swap in (False, True, "stale"):
            used["swap"] = swap is True
            stale["on"] = swap == "stale"
            _launch.DirectLaunch.__call__ = both
            try:
                for name, hook, state, buckets in cases:
                    used["calls"] = 0
                    log = []
                    for stream in (STREAMS[:1] if swap is True else STREAMS):  # one step per stream
                        current["stream"] = stream
                        step(hook, state, buckets)
                        log += take_log()
                    current["stream"] = STREAM
                    pairs = len(log) // 2
                    mismatches = [[log[2 * i], log[2 * i + 1]] for i in range(pairs) if log[2 * i] != log[2 * i + 1]]
                    kind = {False: "plain", True: "swapped", "stale": "stale"}[swap]
                    results.setdefault(name, {})[kind] = dict(
                        records=len(log), pairs=pairs, direct_c_calls=used["calls"], mismatches=len(mismatches),
                        first_mismatch=mismatches[0] if mismatches else None,
                        unregistered=sum("args=unregistered" in ln for ln in log),
                        streams=sorted({ln.split(" stream=")[1].split()[0] for ln in log}),
                        sample=log[0] if log else None)
            finally:
                _launch.DirectLaunch.__call__ = plain_call
                used["swap"] = stale["on"] = False
        out["cases"] = results
        out["stub_launches"] = stub.psgd_stub_launches()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
