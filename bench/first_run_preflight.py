#!/usr/bin/env python3
"""Preflight of the first GPU run (``bench/gpu_first_run.sh``): is this machine able to run the rest at all?

    PYTHONPATH=. python bench/first_run_preflight.py --out DIR [--dry-run]

Checks, each recorded in ``DIR/preflight.json`` (written after every check, so a hang still leaves the earlier ones):
versions (Python, torch, Triton, numpy, this package; which optional packages are importable: the GPU image has no
platformdirs, tqdm), the GPU (name, compute capability, SM count, memory, driver), NCCL (available, version, a
1-rank process group and an all-reduce on it), what Triton's launcher needs to be built (a C compiler, ``Python.h``),
and one trivial Triton kernel compiled, launched and checked. ``--dry-run``: on CPU, the trivial kernel under the
interpreter and gloo instead of NCCL; the GPU checks are listed as skipped. Exit status 1 when a check that the rest
of the run needs failed (no CUDA on a GPU run, NCCL, the C compiler or ``Python.h``, the trivial launch).
"""

import argparse
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("platformdirs", "filelock", "tqdm", "sklearn", "mlxtend", "pytest")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"dry_run": args.dry_run, "checks": {}, "skipped": [], "blocking": []}
    t0 = time.time()

    def save():
        res["seconds"] = round(time.time() - t0, 2)
        (out / "preflight.json").write_text(json.dumps(res, indent=1, default=str))

    def check(name, fn, blocking=True):
        t = time.time()
        try:
            value = fn()
            res["checks"][name] = dict(ok=True, value=value, seconds=round(time.time() - t, 2))
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            res["checks"][name] = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                                       trace=traceback.format_exc()[-3000:], seconds=round(time.time() - t, 2))
            if blocking:
                res["blocking"].append(name)
        status = "ok" if res["checks"][name]["ok"] else "FAILED"
        shown = res["checks"][name].get("value", res["checks"][name].get("error"))
        print(f"preflight {name}: {status}: {json.dumps(shown, default=str)[:400]}", flush=True)
        save()

    def versions():
        import numpy
        import torch
        import triton

        import powersgd_triton

        present = {}
        for mod in OPTIONAL:
            try:
                __import__(mod)
                present[mod] = True
            except ImportError:
                present[mod] = False
        return dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                    numpy=numpy.__version__, powersgd_triton=getattr(powersgd_triton, "__version__", "?"),
                    package_from=str(Path(powersgd_triton.__file__).parent), optional_importable=present,
                    cuda_build=torch.version.cuda)

    def gpu():
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        return dict(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                    devices=torch.cuda.device_count(), driver=getattr(torch._C, "_cuda_getDriverVersion",
                                                                      lambda: None)())

    def process_group():
        import torch
        import torch.distributed as dist

        backend = "gloo" if args.dry_run else "nccl"
        nccl = dict(available=dist.is_nccl_available())
        if not args.dry_run:
            nccl["version"] = ".".join(map(str, torch.cuda.nccl.version()))
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            t = torch.ones(4, device="cpu" if args.dry_run else "cuda")
            dist.all_reduce(t)
            if t.sum().item() != 4:  # world size 1: unchanged
                raise RuntimeError(f"all_reduce on 1 rank changed the tensor: {t.tolist()}")
        finally:
            dist.destroy_process_group()
        return dict(backend=backend, **nccl)

    def launcher_build():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        include = sysconfig.get_paths()["include"]
        header = os.path.join(include, "Python.h")
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc, clang, $CC): Triton cannot build its launcher")
        if not os.path.exists(header):
            raise RuntimeError(f"no Python.h in {include}: Triton cannot build its launcher")
        return dict(cc=cc, python_h=header)

    def trivial_launch():
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)

        device = "cpu" if args.dry_run else "cuda"
        x = torch.arange(1000, dtype=torch.float32, device=device)
        t = time.time()
        add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.time() - t
        expect = torch.arange(1000, dtype=torch.float32, device=device) + 1
        if not torch.equal(x, expect):
            raise RuntimeError("the trivial kernel computed a wrong result")
        return dict(device=device, first_launch_seconds=round(seconds, 2), interpreter=args.dry_run)

    check("versions", versions)
    if args.dry_run:
        res["skipped"].append("gpu: dry run (CPU)")
    else:
        check("gpu", gpu)
    check("process_group", process_group)
    if args.dry_run:
        res["skipped"].append("launcher build: the interpreter builds none (checked anyway, not blocking)")
    check("launcher_build", launcher_build, blocking=not args.dry_run)
    check("trivial_launch", trivial_launch)
    save()
    print(f"preflight: {len(res['blocking'])} blocking failure(s): {', '.join(res['blocking']) or 'none'}",
          flush=True)
    return 1 if res["blocking"] else 0


if __name__ == "__main__":
    sys.exit(main())
