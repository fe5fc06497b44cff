"""Section ``compile``: what the later sections launch, compiled first (JIT warm-up workers on a GPU, sm_90 AOT in the
dry run), with registers, spills, shared memory and occupancy per binary."""

import json
import os
import sys
import time
from pathlib import Path

import torch

from powersgd_triton import benchmarking as B
from powersgd_triton.shapes import numel

from . import streams as S
from . import verify as V
from .common import (ARGS, BUCKET_MB, COMPILE_BUDGET, DRY, ENTRY, FIRST_BUCKET_MB, MAX_HOOK_BUCKETS, QUICK, RESERVE,
                     RESULTS, ROOT, SHRINK, _dn, _dt, _fmt, _fmt_consts, generator, left, log, sync)
from .correctness import _ragged_shapes, check_kernel, correctness_plan
from .hooks import _hook_buckets, _pg_backend, hook_plan
from .kernels import _kernel_bench, _kernel_buckets, kernel_plan
from .nonfinite import SPECIAL_SHAPES, check_special, special_plan
from .paths import CASES as PATH_CASES
from .paths import case_shapes, check_path

# =============================================================================================== 2b. compile


def warm_items():
    """Every item the later sections will run, as JSON lists, in their order: what the compile phase warms."""
    chosen = ARGS.sections.split(",")
    items = []
    if "correctness" in chosen:
        items += [["correctness", v, kind, _dn(dt), r] for v, kind, dt, r in correctness_plan()]
    if "nonfinite" in chosen:
        items += [["nonfinite", v, _dn(dt), r] for v, dt, r in special_plan()]
    if "paths" in chosen:
        items += [["paths", case, _dn(dt), r] for case, dt, r in PATH_CASES]
    if "verify" in chosen and V.available():
        items += [["verify", "powerSGD", "float32", V.RANK]]
    if "streams" in chosen:
        items += [["streams", name, _dn(dt), S.RANK] for name, dt in S.plan()]
    for sec, extra in (("kernels", False), ("kernels-extra", True)):
        if sec in chosen:
            items += [["kernels", m, _dn(dt), r] for m, dt, r, _ in kernel_plan(extra)]
    for sec, extra in (("hooks", False), ("hooks-extra", True)):
        if sec in chosen:
            items += [["hooks", m, _dn(dt), r] for m, r, dt in hook_plan(extra)]
    out = []
    for it in items:  # the same item twice (e.g. kernels and kernels-extra) is warmed once
        if it not in out:
            out.append(it)
    return out


def run_item(item, gen):
    """Run one item of a later section once, untimed (the compile phase's workers)."""
    kind = item[0]
    if kind == "correctness":
        _, v, lay, dt, r = item
        return check_kernel(v, lay, _dt(dt), r, gen)
    if kind == "nonfinite":
        _, v, dt, r = item
        return check_special(v, _dt(dt), r, gen)
    if kind == "paths":
        _, case, dt, r = item
        return check_path(case, _dt(dt), r, gen)
    if kind == "verify":  # the Triton backend's steps of the section's buckets (the check's replays are torch's)
        _pg_backend()
        V.warm(gen)
        sync()
        return None
    if kind == "streams":  # the hook's steps on the section's buckets, uninjected (the same launches)
        _, name, dt, _ = item
        _pg_backend()
        S.warm(name, _dt(dt))
        sync()
        return None
    if kind == "kernels":
        _, model, dt, r = item
        for d in _kernel_buckets(model, _dt(dt)):
            _, kb = _kernel_bench(d, _dt(dt), r, gen)
            for kernel in B.KERNELS:
                kb.ours(kernel, backend="triton")()
            sync()
        return None
    if kind == "hooks":
        _, model, dt, r = item
        _pg_backend()
        B.HookStep("ours", _hook_buckets(model, _dt(dt), gen), r, backend="triton").warmup(1)
        sync()
        return None
    raise ValueError(item)


def _group_key(item):
    """Items that launch the same binaries go to the same worker (it compiles them once)."""
    if item[0] in ("correctness", "nonfinite"):
        v = item[1]
        dt = None if v.startswith("orthogonalize") else item[-2]  # the factors are float32 whatever the bucket
        return (v, dt, item[-1])
    return tuple(item)


def _assign(items, n):
    """Split items into n lists: groups of the same binaries kept together, biggest groups first, least loaded."""
    groups = {}
    for it in items:
        groups.setdefault(_group_key(it), []).append(it)
    cost = lambda g: len(g) + (g[0][-1] ** 2 / 8.0 if str(g[0][1]).startswith("orthogonalize") else 0)  # noqa
    loads = [[0.0, []] for _ in range(n)]
    for g in sorted(groups.values(), key=lambda g: (g[0][0] == "hooks", -cost(g))):
        slot = min(loads, key=lambda x: x[0])
        slot[0] += cost(g)
        slot[1].extend(g)
    return [x[1] for x in loads]


def _jit_binaries():
    """``{(kernel name, hash): compiled kernel}`` of everything Triton's JIT compiled (or loaded) in this process."""
    from powersgd_triton.ops import kernels

    out = {}
    for name, fn in kernels.KERNEL_FUNCTIONS.items():
        jit = fn if hasattr(fn, "device_caches") else getattr(fn, "fn", None)  # a JITFunction, maybe wrapped
        for caches in getattr(jit, "device_caches", {}).values():
            for k in list(caches[0].values()):
                if hasattr(k, "metadata") and hasattr(k, "asm"):
                    out[(name, getattr(k, "hash", id(k)))] = k
    return out


def _describe(name, k):
    """Constexprs, gradient dtype, warps/stages of a JIT-compiled binary (best effort across Triton versions)."""
    from powersgd_triton.ops import kernels

    fn = kernels.KERNEL_FUNCTIONS[name]
    names = list(getattr(fn, "arg_names", []))

    def arg(key):
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        return names[key] if isinstance(key, int) and key < len(names) else str(key)

    src = getattr(k, "src", None)
    consts = getattr(src, "constexprs", None) or getattr(src, "constants", None) or {}
    sig = getattr(src, "signature", None) or {}
    first = sig.get(names[0], sig.get(0)) if names else None
    md = k.metadata
    return dict(kernel=name, hash=str(getattr(k, "hash", ""))[:16],
                constexprs={arg(a): v for a, v in consts.items() if isinstance(v, (bool, int, float, str))},
                dtype=str(first).lstrip("*") if first else None, num_warps=getattr(md, "num_warps", None),
                num_stages=getattr(md, "num_stages", None))


def _usage(name, k):
    from tools.aot import resource_usage

    row = {}
    if getattr(k, "function", None) is None:
        try:
            k._init_handles()
        except Exception:  # noqa: BLE001
            pass
    row["n_regs"], row["n_spills"] = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
    try:
        row["usage"] = resource_usage(k, int(k.metadata.target.arch))
    except Exception as exc:  # noqa: BLE001
        row["usage_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def warm_worker() -> int:
    """Compile-phase worker (GPU): run my share of the items once; record every binary compiled on the way."""
    i, _ = (int(x) for x in ARGS.warm_worker.split("/"))
    out = Path(ARGS.warm_out)
    mine = json.loads((out.parent / "items.json").read_text())[i]
    report = {"worker": i, "items": [], "binaries": []}
    gen = generator()

    def write():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, default=str))
        os.replace(tmp, out)

    known = _jit_binaries()
    parent = os.getppid()
    for item in mine:
        if os.getppid() != parent or (ARGS.warm_deadline and time.time() > ARGS.warm_deadline):
            break  # the run went on without us (or ended): stop, leave no orphan on the GPU
        t0 = time.time()
        err = None
        try:
            run_item(item, gen)
        except Exception as exc:  # noqa: BLE001 - the section itself reports it again
            err = f"{type(exc).__name__}: {str(exc)[:300]}"
        dt = time.time() - t0
        now = _jit_binaries()
        new = [key for key in now if key not in known]
        known = now
        report["items"].append(dict(item=item, seconds=round(dt, 2), compiled=len(new), error=err))
        for key in new:  # the item's time is its compiles' (a launch on these shapes takes microseconds)
            row = dict(_describe(key[0], now[key]), compile_s=round(dt / len(new), 2), item=" ".join(map(str, item)))
            row.update(_usage(key[0], now[key]))
            report["binaries"].append(row)
        write()
    report["done"] = True
    write()
    return 0


def _aot_cases(items):
    """The bucket cases (shapes, dtype, rank) of the items, for ``tools.aot --plan`` (dry run)."""
    from powersgd_triton.autotune.keys import dtype_name

    cases, seen = [], set()

    def add(label, dt, rank, shapes=None, numel_=None, rate=2.0):
        key = (dt, rank, json.dumps(shapes), numel_, rate)
        if key in seen:
            return
        seen.add(key)
        c = dict(label=label, dtype=dtype_name(_dt(dt)), rank=rank, min_compression_rate=rate)
        c.update(dict(batched=True, numel=numel_) if numel_ else dict(shapes=[list(x) for x in shapes]))
        cases.append(c)

    gcpu = torch.Generator().manual_seed(0)
    for it in items:
        if it[0] == "correctness":
            _, v, kind, dt, r = it
            if kind == "batched":
                add(f"batched {dt} r{r}", dt, r, numel_=20_011 if DRY else 1_000_003)
            elif kind == "ragged":
                add(f"ragged {dt} r{r}", dt, r, _ragged_shapes(gcpu), rate=0.5)
            else:
                groups = B.model_bucket_shapes(kind, _dt(dt), BUCKET_MB, FIRST_BUCKET_MB,
                                               SHRINK * (2 if (DRY and kind == "gpt2") else 1))
                shapes = max(groups, key=len) if kind == "resnet50" else max(
                    groups, key=lambda g: sum(numel(x) for x in g))
                add(f"{kind} {dt} r{r}", dt, r, shapes)
        elif it[0] == "nonfinite":
            add(f"nonfinite {it[2]} r{it[3]}", it[2], it[3], SPECIAL_SHAPES, rate=1.0)
        elif it[0] == "paths":
            add(f"paths {it[1]} {it[2]} r{it[3]}", it[2], it[3], case_shapes(it[1], it[3]), rate=1.0)
        elif it[0] in ("verify", "streams"):  # PowerSGDState's default min_compression_rate (2)
            _, hook, dt, r = it
            for bi, shapes in enumerate(V.BUCKETS if it[0] == "verify" else S.buckets()):
                if hook == "batched":
                    add(f"{it[0]} batched b{bi} {dt} r{r}", dt, r, numel_=sum(numel(x) for x in shapes))
                else:
                    add(f"{it[0]} b{bi} {dt} r{r}", dt, r, shapes)
        elif it[0] == "kernels":
            _, model, dt, r = it
            for d in _kernel_buckets(model, _dt(dt)):
                add(f"{model} b{d['index']} {dt} r{r}", dt, r, d["shapes"])
        elif it[0] == "hooks":
            _, model, dt, r = it
            groups = B.model_bucket_shapes(model, _dt(dt), BUCKET_MB, FIRST_BUCKET_MB, SHRINK)
            for bi, shapes in enumerate(groups[:MAX_HOOK_BUCKETS] if MAX_HOOK_BUCKETS else groups):
                add(f"hook {model} b{bi} {dt} r{r}", dt, r, shapes)
    return cases


def _wait(procs, deadline):
    """Wait for the processes until ``deadline``; kill (process group) the ones still running. Returns them."""
    import signal

    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    late = [p for p in procs if p.poll() is None]
    for p in late:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            p.kill()
        p.wait()
    return late


def _child_env(interpret: bool, aot: bool = False):
    """The environment of a compile-phase child. Workers keep this process's (Triton's cache key may include
    environment variables: a difference would make their binaries miss in this process)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if aot:
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    return env


def section_compile():
    import subprocess
    import tempfile

    items = warm_items()
    sec = RESULTS["sections"]["compile"] = {"items": len(items), "budget_s": COMPILE_BUDGET, "binaries": []}
    budget = max(0.0, min(COMPILE_BUDGET, left() - RESERVE["compile"]))
    deadline = time.time() + budget
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_compile_"))
    jobs = max(1, ARGS.jobs or min(16, os.cpu_count() or 1))
    t0 = time.time()
    mode = ARGS.compile_mode if ARGS.compile_mode != "auto" else ("aot" if DRY else "workers")
    if mode == "aot":
        # The interpreter compiles nothing: compile for sm_90 ahead of time what a GPU run would launch.
        cases = _aot_cases(items)
        (tmp / "cases.json").write_text(json.dumps(cases))
        jsonl = tmp / "aot.jsonl"
        cmd = [sys.executable, "-m", "tools.aot", "--plan", str(tmp / "cases.json"), "--jsonl",
               str(jsonl), "--archs", "90", "--jobs", str(min(jobs, 2)), "--usage"]
        sec.update(mode="ahead of time, sm_90 (dry run: the checks run in the interpreter)", cases=len(cases),
                   processes=min(jobs, 2))
        log(f"  AOT-compiling what {len(items)} items launch ({len(cases)} bucket cases) for sm_90, "
            f"{min(jobs, 2)} processes, {budget:.0f}s")
        with open(tmp / "aot.log", "w") as logf:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(False, aot=True), stdout=logf,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True)
            late = _wait([proc], deadline)
        done = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
        planned_file = Path(str(jsonl) + ".planned")
        planned = json.loads(planned_file.read_text()) if planned_file.exists() else []
        for r in done:
            u = r.get("usage") or {}
            cfg = r.get("config_used", r["config"])
            sec["binaries"].append(dict(kernel=r["kernel"], constexprs=dict(cfg, R=r["R"], **r["variant"]),
                                        dtype=r["dtype"], arch=r["arch"], compile_s=r["seconds"], ok=r["ok"],
                                        error=r.get("error"), item=r.get("case"), usage=u or None,
                                        usage_error=r.get("usage_error"), num_warps=u.get("num_warps"),
                                        num_stages=u.get("num_stages")))
            if not r["ok"]:
                RESULTS["errors"][f"compile:{r['kernel']} {r['config']} {r['variant']}"] = r.get("error")
        key = lambda j: (j["kernel"], json.dumps(j["config"], sort_keys=True), j["R"], j["dtype"],  # noqa: E731
                         json.dumps(j["variant"], sort_keys=True))
        got = {key(r) for r in done}
        rest = [j for j in planned if key(j) not in got]
        if rest or late or not planned:
            by = {}
            for j in rest:
                by[j["kernel"]] = by.get(j["kernel"], 0) + 1
            why = f"compile budget {budget:.0f}s" if late else "the AOT run ended early (see its log)"
            RESULTS["skipped"].append(f"compile: {len(rest)} of {len(planned)} planned compilations not done "
                                      f"({why}): " + ", ".join(f"{k} x{n}" for k, n in by.items()))
            if not late and not planned:
                RESULTS["errors"]["compile"] = (tmp / "aot.log").read_text()[-3000:]
    else:
        n = min(jobs, len(items)) or 1
        shares = _assign(items, n)
        (tmp / "items.json").write_text(json.dumps(shares))
        sec.update(mode=f"JIT warm-up in {n} worker processes (Triton's on-disk cache)", processes=n)
        log(f"  warming {len(items)} items in {n} processes, {budget:.0f}s")
        procs, logs = [], []
        for i in range(n):
            logs.append(open(tmp / f"w{i}.log", "w"))
            cmd = [sys.executable, str(ENTRY), "--warm-worker", f"{i}/{n}", "--warm-out",
                   str(tmp / f"w{i}.json"), "--sections", ARGS.sections, "--warm-deadline", str(deadline)] + (
                   ["--quick"] if QUICK else []) + (["--dry-run"] if DRY else [])
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_child_env(DRY), stdout=logs[-1],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        late = _wait(procs, deadline)
        for f in logs:
            f.close()
        seen, unfinished, item_errors = set(), [], []
        for i in range(n):
            path = tmp / f"w{i}.json"
            rep = json.loads(path.read_text()) if path.exists() else {"items": [], "binaries": []}
            finished = [x["item"] for x in rep["items"]]
            unfinished += [it for it in shares[i] if it not in finished]
            item_errors += [f"{' '.join(map(str, x['item']))}: {x['error']}" for x in rep["items"] if x["error"]]
            for b in rep["binaries"]:
                if (b["kernel"], b["hash"]) in seen:
                    continue  # two workers compiled the same binary
                seen.add((b["kernel"], b["hash"]))
                sec["binaries"].append(b)
            if procs[i].returncode not in (0, None) and procs[i] not in late:
                tail = (tmp / f"w{i}.log").read_text()[-1500:]
                RESULTS["errors"][f"compile:worker {i}"] = f"exit {procs[i].returncode}: {tail}"
        sec["item_errors"] = item_errors
        sec["items_warmed"] = len(items) - len(unfinished)
        if unfinished:
            RESULTS["skipped"].append(f"compile: {len(unfinished)} of {len(items)} items not warmed (compile budget "
                                      f"{budget:.0f}s; they compile in their own section): "
                                      + "; ".join(" ".join(map(str, it)) for it in unfinished[:20]))
    sec["seconds"] = round(time.time() - t0, 1)
    per = {}
    for b in sec["binaries"]:
        d = per.setdefault(b["kernel"], dict(binaries=0, seconds=0.0, max_s=0.0))
        d["binaries"] += 1
        d["seconds"] = round(d["seconds"] + (b.get("compile_s") or 0.0), 2)
        d["max_s"] = max(d["max_s"], b.get("compile_s") or 0.0)
    sec["per_kernel"] = per
    for k, d in per.items():
        log(f"  {k:14s} {d['binaries']:3d} binaries, {d['seconds']:7.1f} s compiling, max {d['max_s']:5.1f} s")
    for b in sec["binaries"]:
        u = b.get("usage") or {}
        log(f"    {b['kernel']:14s} {_fmt_consts(b.get('constexprs'))[:60]:60s} {b.get('dtype') or '':8s} "
            f"regs {_fmt(u.get('registers'), 'd')} spill {_fmt(u.get('spill_bytes'), 'd')} "
            f"smem {_fmt(u.get('shared_bytes'), 'd')} blocks/SM {_fmt(u.get('blocks_per_sm'), 'd')}"
            + (f" n_regs {b.get('n_regs')} n_spills {b.get('n_spills')}" if b.get("n_regs") is not None else ""))
    log(f"  compile phase: {len(sec['binaries'])} binaries in {sec['seconds']} s")
