"""The markdown summary (``gpu_check.md``) and the benchmark history lines of a run."""

from pathlib import Path

from powersgd_triton import benchmarking as B

from .common import (ARGS, BUCKET_MB, BUDGET, DEVICE, DRY, RANK, RESULTS, ROOT, _fmt, _fmt_consts, copy_gbs, elapsed,
                     log, save)

# =============================================================================================== summary


def _sum_or_none(values, weights):
    if not values or any(v is None for v in values):
        return None
    return sum(v * w for v, w in zip(values, weights))


def _checked_sections(S) -> list:
    """The markdown of sections paths, verify, streams and model."""
    lines = []
    paths = S.get("paths")
    if paths:
        lines += ["", f"## GPU paths (heuristic configs) vs float64: {paths.get('passed', 0)} passed, "
                      f"{paths.get('failed', 0)} failed of {len(paths.get('cases', []))} run", "",
                  "| case | dtype | r | path taken | checks (rel. error / tolerance) |", "| --- | --- | --- | --- | --- |"]
        for r in paths.get("cases", []):
            if "error" in r:
                lines.append(f"| {r['case']} | {r['dtype']} | {r[RANK]} | ERROR | {r['error'][:120]} |")
                continue
            taken = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["path"].items())
            checks = ", ".join(f"{k} {v:.1e} / {r['tolerances'][k]:.0e}" for k, v in r["checks"].items())
            lines.append(f"| {r['case']} | {r['dtype']} | {r[RANK]} | {taken} | {checks} |")
    ver = S.get("verify")
    if ver and ver.get("cases"):
        lines += ["", "## First-use check (verify='first')", "", "| case | ok | RuntimeWarnings | worst rel. vs torch |",
                  "| --- | --- | --- | --- |"]
        for r in ver["cases"]:
            lines.append(f"| {r['case']} | {'ok' if r.get('ok') else 'FAIL'} | {len(r.get('runtime_warnings', []))} | "
                         f"{_fmt(r.get('worst_rel_vs_torch'), '.1e')} |")
    st = S.get("streams")
    if st and st.get("rows"):
        lines += ["", f"## Sleep injection (then() callbacks, next-Q side stream), {st.get('process_group')}, "
                      f"{st.get('buckets')} buckets x {st.get('steps')} steps", "",
                  "| hook | dtype | ok | callbacks delayed | side-stream delayed | worst rel. vs torch | bitwise vs no "
                  "injection |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in st["rows"]:
            lines.append(f"| {r['hook']} | {r['dtype']} | {'ok' if r['ok'] else 'FAIL'} | {r['callbacks_delayed']} | "
                         f"{r['side_stream_delayed']} | {r['worst_rel_vs_torch']:.1e} | {r['bitwise_vs_no_injection']} |")
    mod = S.get("model")
    if mod and mod.get("planned"):
        lines += ["", f"- performance model: {mod.get('made', 0)} of {mod['planned']} predictions made before the "
                      f"timed sections ({mod.get('seconds', 0)} s)"
                  + (f"; {len(mod['missed'])} looked up but not made" if mod.get("missed") else "")]
    return lines


def summary() -> str:
    S = RESULTS["sections"]
    lines = ["# powersgd_triton gpu_check" + (" (DRY RUN: CPU + interpreter, tiny shapes)" if DRY else ""), ""]
    env = S.get("env", {})
    lines.append(f"- date {env.get('date')}, GPU {env.get('gpu', '-')} (cc {env.get('capability', '-')}, "
                 f"{env.get('sms', '-')} SMs, L2 {env.get('l2_mib', '-')} MiB), driver/clocks "
                 f"{env.get('nvidia_smi', '-')}")
    lines.append(f"- python {env.get('python')}, torch {env.get('torch')}, triton {env.get('triton')}, "
                 f"CUDA {env.get('cuda', '-')}; checkout {env.get('git', '-')}; process group {RESULTS.get('pg', '-')}")
    lines.append("- command: `PYTHONPATH=. python bench/gpu_check.py" + (" --dry-run`" if DRY else "`")
                 + f"; elapsed {elapsed():.0f} s of {BUDGET:.0f} s budget")
    c = S.get("copy")
    if c:
        lines.append(f"- copy bandwidth (copy_ of {c['bytes'] / 2e9:.2f} GB, read + written): "
                     f"**{c['gb_s']:.0f} GB/s** (median {c['median_ms']:.3f} ms)")
    comp = S.get("compile")
    if comp:
        lines += ["", f"## Compile phase: {len(comp.get('binaries', []))} binaries, {comp.get('seconds', '-')} s "
                      f"(budget {comp.get('budget_s', 0):.0f} s; {comp.get('mode', '')})", "",
                  "| kernel | binaries | compile s (total) | max s |", "| --- | --- | --- | --- |"]
        for k, d in comp.get("per_kernel", {}).items():
            lines.append(f"| {k} | {d['binaries']} | {d['seconds']:.1f} | {d['max_s']:.1f} |")
        rows = comp.get("binaries", [])
        if rows:
            gpu = any(b.get("n_regs") is not None for b in rows)
            lines += ["", "### Registers, spills, shared memory, occupancy per compiled binary"
                      + (" (ptxas -v; n_regs / n_spills: the loaded kernel, n_spills in 4-byte words)" if gpu
                         else " (ptxas -v on the sm_90 compile)"), "",
                      "| kernel | constexprs / config | dtype | warps | stages | registers | spill bytes | shared B | "
                      "blocks/SM (limit) |" + (" n_regs | n_spills |" if gpu else "") + " compile s |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if gpu else "")
                      + " --- |"]
            for b in rows:
                u = b.get("usage") or {}
                lim = ""
                if u:
                    limits = {k[3:]: u[k] for k in ("by_registers", "by_shared", "by_warps", "by_blocks")}
                    lim = f" ({min(limits, key=limits.get)})"
                lines.append(f"| {b['kernel']} | {_fmt_consts(b.get('constexprs'))} | {b.get('dtype') or '-'} | "
                             f"{_fmt(b.get('num_warps'), 'd')} | {_fmt(b.get('num_stages'), 'd')} | "
                             f"{_fmt(u.get('registers'), 'd')} | {_fmt(u.get('spill_bytes'), 'd')} | "
                             f"{_fmt(u.get('shared_bytes'), 'd')} | {_fmt(u.get('blocks_per_sm'), 'd')}{lim} |"
                             + (f" {_fmt(b.get('n_regs'), 'd')} | {_fmt(b.get('n_spills'), 'd')} |" if gpu else "")
                             + f" {_fmt(b.get('compile_s'), '.1f')} |"
                             + (f" {b['usage_error'][:80]}" if b.get("usage_error") else ""))
    corr = S.get("correctness")
    if corr:
        lines += ["", f"## Correctness vs float64: {corr.get('passed', 0)} passed, {corr.get('failed', 0)} failed "
                      f"of {len(corr.get('cases', []))} run ({corr.get('planned', '?')} planned)", ""]
        bad = [r for r in corr.get("cases", []) if not r.get("ok")]
        if bad:
            lines.append("| variant | layout | dtype | r | checks / error |")
            lines.append("| --- | --- | --- | --- | --- |")
            for r in bad[:40]:
                detail = r.get("error") or ", ".join(f"{k}={v:.2e}" for k, v in r.get("checks", {}).items())
                detail += f", nonfinite={r.get('nonfinite')}" if "nonfinite" in r else ""
                lines.append(f"| {r['variant']} | {r['layout']} | {r['dtype']} | {r[RANK]} | {detail} |")
    nf = S.get("nonfinite")
    if nf:
        lines += ["", f"## Non-finite inputs (inf, NaN payloads): {nf.get('passed', 0)} passed, {nf.get('failed', 0)} "
                      f"failed of {len(nf.get('cases', []))} run ({nf.get('planned', '?')} planned)", "",
                  "Values put in: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in nf.get("values", {}).items()),
                  "Per output: elements non-finite in the float64 oracle / finite here where the oracle is not (missed: "
                  "a finite wrong answer) / non-finite here in a matrix the oracle keeps finite (spurious); (+n): "
                  "extra non-finite elements inside a matrix the oracle already makes non-finite (not a failure).",
                  "", "| variant | dtype | r | ok | output: non-finite expected / missed / spurious | inputs |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in nf.get("cases", []):
            if "error" in r:
                lines.append(f"| {r['variant']} | {r['dtype']} | {r[RANK]} | ERROR | {r['error'][:120]} | |")
                continue
            detail = "; ".join(f"{k} {c['nonfinite_expected']}/{c['missed']}/{c['spurious']}"
                               + (f" (+{c['spurious_within']})" if c.get("spurious_within") else "")
                               for k, c in r["checks"].items())
            lines.append(f"| {r['variant']} | {r['dtype']} | {r[RANK]} | {'ok' if r['ok'] else 'FAIL'} | {detail} | "
                         f"{', '.join(r.get('placed', []))[:160]} |")
    k = S.get("kernels", {}).get("rows")
    if k:
        lines += ["", "## Kernel bandwidth (byte model: bytes read + written once), 25 MB buckets", "",
                  "| model | dtype | r | kernel | ours GB/s | % of copy (all 25 MB buckets) | min % | PyTorch GB/s | "
                  "PyTorch/ours time | ours ms | model ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        keys = []
        for r in k:
            kk = (r["model"], r["dtype"], r[RANK], r["kernel"])
            if kk not in keys:
                keys.append(kk)
        for kk in keys:
            sel = [r for r in k if (r["model"], r["dtype"], r[RANK], r["kernel"]) == kk and r["is_25mb"]]
            ours = [r for r in sel if r["impl"] == "ours"]
            pt = [r for r in sel if r["impl"] == "pytorch"]
            if not ours:
                continue

            def agg(rs):
                b = sum(r["bytes"] * r["occurs"] for r in rs)
                t = sum(r["median_ms"] * r["occurs"] for r in rs)
                return b / t / 1e6 if t else None, t

            og, ot = agg(ours)
            pg, pt_t = agg(pt) if pt else (None, None)
            cb = copy_gbs()
            fr = [r["frac_copy"] for r in ours if r.get("frac_copy") is not None]
            lines.append(f"| {kk[0]} | {kk[1]} | {kk[2]} | {kk[3]} | {_fmt(og, '.0f')} | "
                         f"{_fmt(100 * og / cb if (og and cb) else None, '.0f')} | "
                         f"{_fmt(100 * min(fr) if fr else None, '.0f')} | {_fmt(pg, '.0f')} | "
                         f"{_fmt(pt_t / ot if (pt_t and ot) else None, '.2f')} | {_fmt(ot, '.3f')} | "
                         f"{_fmt(_sum_or_none([r.get('model_ms') for r in ours], [r['occurs'] for r in ours]), '.3f')} |")
        big = [r for r in k if not r["is_25mb"] and r["impl"] == "ours" and r["bucket_bytes"] > 2 * BUCKET_MB * 2**20]
        if big:
            lines += ["", "Buckets larger than 25 MB (e.g. GPT-2's embedding bucket):", "",
                      "| model | bucket | MB | dtype | r | kernel | GB/s | % of copy |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for r in big:
                lines.append(f"| {r['model']} | {r['bucket']} | {r['bucket_bytes'] / 2**20:.0f} | {r['dtype']} | "
                             f"{r[RANK]} | {r['kernel']} | {r['gb_s']:.0f} | "
                             f"{_fmt(100 * r['frac_copy'] if r.get('frac_copy') else None, '.0f')} |")
    h = S.get("hooks", {}).get("rows")
    if h:
        lines += ["", "## Whole hook step (all buckets of the model), world size 1", "",
                  "| model | r | dtype | impl | ms/step (median) | model ms | PyTorch/ours | device kernels/step | "
                  "Triton launches | ATen compute ops | all-reduces (bytes) | held | peak extra |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in h:
            other = [x for x in h if (x["model"], x[RANK], x["dtype"]) == (r["model"], r[RANK], r["dtype"])
                     and x["impl"] == "pytorch"]
            ratio = other[0]["median_ms"] / r["median_ms"] if (other and r["impl"] == "ours") else None
            lines.append(f"| {r['model']} | {r[RANK]} | {r['dtype']} | {r['variant']} | {r['median_ms']:.3f} | "
                         f"{_fmt(r.get('model_ms'), '.3f')} | {_fmt(ratio, '.2f')} | {_fmt(r.get('kernels_per_step'), 'd')} | "
                         f"{_fmt(r.get('triton_launches'), 'd')} | {_fmt(r.get('aten_compute'), 'd')} | "
                         f"{_fmt(r.get('allreduce_calls'), 'd')} ({B.fmt_bytes(r.get('allreduce_bytes'))}) | "
                         f"{B.fmt_bytes(r.get('held_bytes'))} | {B.fmt_bytes(r.get('peak_extra_bytes'))} |")
    lines += _checked_sections(S)
    if RESULTS["errors"]:
        lines += ["", "## Errors", ""]
        for key, msg in RESULTS["errors"].items():
            lines.append(f"- `{key}`: {msg.splitlines()[0][:300]}")
    if RESULTS["skipped"]:
        lines += ["", "## Skipped (what, and why)", ""] + [f"- {s}" for s in RESULTS["skipped"]]
    return "\n".join(lines) + "\n"


def record_history(failed: bool) -> None:
    """The kernel and hook timings as benchmark history lines (powersgd_triton.history), keyed by this checkout's
    commit and the GPU: into ``--history`` (default bench/history.jsonl on a GPU, none in the dry run) and a copy in
    ``$OUT/history.jsonl``. Correctness-gated: nothing is recorded unless the correctness and non-finite sections ran
    and every case passed, and no section raised."""
    from powersgd_triton import history as H

    secs = RESULTS["sections"]
    ran = "correctness" in secs and "nonfinite" in secs and "passed" in secs["correctness"]
    if failed or not ran:
        why = "a correctness or non-finite case failed, or a section raised" if failed else \
            "the correctness and non-finite sections did not both run"
        RESULTS["history"] = f"not recorded: {why}"
        log(f"history: {RESULTS['history']}")
        save()
        return
    commit, dirty = H.git_commit(str(ROOT))
    env = secs.get("env") or B.environment(DEVICE)
    records = []
    for name in ("kernels", "hooks"):  # the extra sections add their rows to these
        rows = (secs.get(name) or {}).get("rows") or []
        records += H.make_records(rows, source=f"gpu_check.{name}" + (".dry" if DRY else ""), env=env,
                                  commit=commit, dirty=dirty)
    targets = [] if not commit else [p for p in (ARGS.history or (None if DRY else str(ROOT / H.DEFAULT_PATH)),)
                                     if p]
    if ARGS.out:
        targets.append(str(Path(ARGS.out) / "history.jsonl"))
    done = []
    for path in targets:
        try:
            n = H.append(path, records, correct=True)
            done.append(f"{n} lines in {path}")
        except (OSError, ValueError) as exc:
            done.append(f"{path}: {exc}")
    RESULTS["history"] = "; ".join(done) if done else "not recorded: no git commit and no --out"
    log(f"history: {RESULTS['history']}")
    save()

