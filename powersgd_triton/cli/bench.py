"""``powersgd-triton bench``: PyTorch's ``powerSGD_hook`` against ours on real models' buckets, side by side.

World size 1 (an in-process gloo group; nccl on a GPU), DDP-like 25 MB buckets, the two hooks timed in turn
(:func:`powersgd_triton.benchmarking.compare_hooks`), with the counts (ATen compute ops, all-reduce calls and bytes,
memory held and peak). Prints a markdown table; ``--json``/``--markdown`` also write it. For the pytest-benchmark
tables see ``bench/``; for a full GPU check ``bench/gpu_check.py``.

    powersgd-triton bench --models resnet50 --matrix-approximation-ranks 4 --dtypes fp32 --rounds 7
    powersgd-triton bench --kernel-report --models resnet50,gpt2 --dtypes fp32,bf16 --rank 4 --json report.json

``--link RATES`` instead times whole training steps of 2 ranks over a link of each rate
(:mod:`powersgd_triton.linkbench`).
"""

import json

from powersgd_triton.cli_common import RANK_HELP, add_rank_option, comma_list, positive
from powersgd_triton.linkbench import options as link_options  # no torch either
from powersgd_triton.shapes import MODELS  # no torch: the parser is built without it

DTYPE_NAMES = ("fp32", "bf16", "fp16")  # powersgd_triton.benchmarking.DTYPES (tests/test_cli_help.py checks)


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="time PyTorch's powerSGD_hook against ours (world size 1)",
                              description="Time PyTorch's powerSGD_hook against powersgd_triton's on real models' "
                              "buckets, side by side (world size 1, DDP-like 25 MB buckets, the two hooks in turn), "
                              "with ATen ops, all-reduce calls and bytes, and memory; prints a markdown table.")
    p.add_argument("--models", default="resnet50", type=comma_list(MODELS, "model"), metavar="MODEL,...",
                   help=f"comma list of {','.join(MODELS)} (default resnet50)")
    add_rank_option(p, plural=True, deprecated="--ranks", default="4", metavar="R,...",
                    help=RANK_HELP + "; a comma list (default 4)")
    p.add_argument("--dtypes", default="fp32", type=comma_list(DTYPE_NAMES, "dtype"), metavar="DTYPE,...",
                   help="comma list of fp32,bf16,fp16 (default fp32)")
    p.add_argument("--rounds", type=positive(int), default=None,
                   help="timed rounds per hook (default 5; 40 with --host-overhead)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help="our backend: auto, triton or torch (default auto)")
    p.add_argument("--threads", type=positive(int), default=None, help="torch CPU threads")
    p.add_argument("--shrink", type=positive(int), default=1, help="divide channel dims (quick runs)")
    p.add_argument("--no-counts", action="store_true", help="times only")
    p.add_argument("--json", default=None, help="write the rows and the environment as JSON")
    p.add_argument("--markdown", default=None, help="write the table as markdown")
    p.add_argument("--model-only", action="store_true",
                   help="no timing: print the performance model's prediction (powersgd_triton.perfmodel) for "
                        "--models/--matrix-approximation-ranks/--dtypes on --gpu, from the kernels compiled for it (no GPU "
                        "needed; a clone of the repository is: the ahead-of-time compile is its tools/)")
    p.add_argument("--kernel-report", action="store_true",
                   help="no timing, no GPU: compile each launch of a compressed bucket step for sm_90 as Triton's JIT "
                        "compiles it on a GPU and report, per launch, registers, spills, the widest global load and "
                        "store (PTX), SASS instructions per element and the issue ratio, and the launches per bucket "
                        "step (tools/kernel_report.py of a clone of the repository; --json writes it)")
    p.add_argument("--host-overhead", action="store_true",
                   help="no GPU: time the host side of a compressed bucket step, ours (Triton launch path, the C "
                        "launch and the collectives stubbed) against PyTorch's hook, with Python calls per bucket "
                        "step (powersgd_triton.benchmarking.host)")
    p.add_argument("--gpu", default="h200", help="GPU spec of --model-only: h100 or h200 (default h200)")
    p.add_argument("--history", default=None, metavar="PATH",
                   help="append the rows to this benchmark history (JSON lines keyed by git commit and device; "
                        "default: bench/history.jsonl when run from a git checkout of this project), only when ours "
                        "agrees with PyTorch's hook on the same buckets (see powersgd_triton.history)")
    p.add_argument("--no-history", action="store_true", help="record nothing in the history")
    p.add_argument("--compare-to", default=None, metavar="REF",
                   help="after the run, compare its rows with the history's rows of git ref REF on this device")
    link_options.add_options(p)  # bench --link RATES (powersgd_triton.linkbench)
    p.set_defaults(func=run)
    return p


def argparse_namespace(**kwargs):
    import argparse

    return argparse.Namespace(**kwargs)


def _usage(message: str) -> int:
    import sys

    print(f"powersgd-triton bench: error: {message}", file=sys.stderr, flush=True)
    return 2


def run(args) -> int:
    if getattr(args, "link", None):
        from powersgd_triton.linkbench.run import run as run_link

        return run_link(args)
    import torch

    from powersgd_triton import benchmarking as B

    from powersgd_triton.shapes import MODELS

    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    try:
        ranks = [int(r) for r in args.matrix_approximation_ranks.split(",") if r]
    except ValueError:
        return _usage("--matrix-approximation-ranks must be a comma list of integers, got "
                      f"{args.matrix_approximation_ranks!r}")
    bad = [m for m in models if m not in MODELS] + [d for d in dtypes if d not in B.DTYPES]
    if bad or not models or not dtypes or not ranks:
        return _usage(f"unknown or empty --models/--dtypes {bad}; models: {sorted(MODELS)}, dtypes: {sorted(B.DTYPES)}")
    if min(ranks) < 1:
        return _usage("--matrix-approximation-ranks must be >= 1")
    if getattr(args, "model_only", False):
        from powersgd_triton import perfmodel

        if args.gpu not in perfmodel.GPUS:
            return _usage(f"--gpu must be one of {sorted(perfmodel.GPUS)}, got {args.gpu!r}")
        return perfmodel.run(argparse_namespace(models=models, ranks=ranks, dtypes=dtypes, gpu=args.gpu))
    if getattr(args, "kernel_report", False):
        from powersgd_triton import perfmodel

        if args.gpu not in perfmodel.GPUS:
            return _usage(f"--gpu must be one of {sorted(perfmodel.GPUS)}, got {args.gpu!r}")
        if len(ranks) != 1:
            return _usage("--kernel-report takes one --matrix-approximation-ranks value")
        perfmodel.checkout_tools()  # the checkout's tools/ on the path (a developer tool, not in the wheel)
        from tools import kernel_report

        return kernel_report.run(models, dtypes, ranks[0], args.json, args.gpu)
    if getattr(args, "host_overhead", False):
        from powersgd_triton.benchmarking import host

        return host.run(models, ranks, dtypes, rounds=args.rounds or 40, shrink=args.shrink, history=args.history,
                        record=not args.no_history)
    args.rounds = args.rounds or 5
    if args.device == "cuda" and not torch.cuda.is_available():
        return _usage("--device cuda: no CUDA device here")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.backend == "triton":
        from powersgd_triton.compat import env as _env

        if not _env.triton_can_run(device):
            return _usage(f"--backend triton cannot run on {device} here: {_env.triton_unavailable_reason(device)} "
                          "(the interpreter is never timed)")
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = args.backend
    if backend == "auto" and device.type == "cpu":
        backend = "torch"  # never the interpreter for timings, even where TRITON_INTERPRET=1 is set
    pg = B.ensure_process_group()
    rows = []
    for model in models:
        for dtype in dtypes:
            for rank in ranks:
                rows += B.compare_hooks(model, rank, dtype, device, backend=backend, rounds=args.rounds,
                                        counts=not args.no_counts, shrink=args.shrink,
                                        bucket_cap_mb=25.0 if args.shrink == 1 else 25.0 / args.shrink ** 2)
    env = B.environment(device)
    checks = {}
    for model in models:
        for dtype in dtypes:
            for rank in ranks:
                checks[model, dtype, rank] = B.check_against_pytorch(
                    model, rank, dtype, device, backend=backend, shrink=args.shrink,
                    bucket_cap_mb=25.0 if args.shrink == 1 else 25.0 / args.shrink ** 2)
    dtype_arg = {str(B._dtype(d)).replace("torch.", ""): d for d in dtypes}  # "float32" -> "fp32"
    for r in rows:
        r["shrink"] = args.shrink
        r["agrees_with_pytorch"] = checks[r["model"], dtype_arg[r["dtype"]], r["matrix_approximation_rank"]]["ok"]
        for k in ("held_bytes", "peak_extra_bytes", "allreduce_bytes", "grad_bytes"):
            if k in r:
                r[k + "_h"] = B.fmt_bytes(r[k])
        if "speedup" in r:
            r["speedup_h"] = f"{r['speedup']:.2f}x"
        if "ops_backend" in r:
            r["ops_backend_h"] = {"pytorch": "PyTorch's hook (ATen ops)", "torch": "our torch backend",
                                  "triton": "our Triton kernels"}[r["ops_backend"]]
    cols = [("model", "model"), ("matrix_approximation_rank", "approx. rank r"), ("dtype", "dtype"),
            ("variant", "hook"), ("buckets", "buckets"), ("median_ms", "median ms"), ("p20_ms", "p20 ms"),
            ("p80_ms", "p80 ms"), ("speedup_h", "PyTorch/ours")]
    if not args.no_counts:
        cols += [("ops_backend_h", "ran as"), ("aten_compute", "ATen compute ops/step"),
                 ("triton_launches", "Triton launches/step"), ("allreduce_calls", "all-reduce calls/step"),
                 ("allreduce_bytes_h", "all-reduced bytes/step"), ("held_bytes_h", "state held"),
                 ("peak_extra_bytes_h", "peak extra memory")]
    head = (f"{env['date']}; {env['cpu']} ({env['cpus_usable']} CPUs usable, torch threads {env['torch_threads']}, "
            f"load {tuple(round(x, 1) for x in env.get('load_avg', ()))}); python {env['python']}, torch "
            f"{env['torch']}, triton {env.get('triton')}; device {device}"
            + (f" ({env.get('gpu')})" if device.type == "cuda" else "") + f"; process group {pg}; our backend "
            f"{backend}; {args.rounds} rounds in turn")
    table = B.markdown_table(rows, cols)
    if not args.no_counts:
        table += ("\n\nCounts are of one compressed step, measured. ATen compute ops: data-touching ATen ops "
                  "dispatched (views and allocations not counted) by what the \"ran as\" column names"
                  + ("; here ours ran its torch backend (the kernels' torch reference, what runs on CPU), so its "
                     "count is that backend's; on a GPU ours runs its Triton kernels, counted as Triton launches "
                     "(plus a few small torch ops)" if any(r.get("ops_backend") == "torch" for r in rows) else "")
                  + ". Memory: state held after the step, and the peak allocated during it above what was allocated "
                  "before.")
    print(head + "\n\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(head + "\n\n" + table + "\n")
    lines = [f"ours vs PyTorch's hook, same buckets, {c['steps']} compressed steps: {model} r={rank} {dtype}: max "
             f"relative difference {c['max_rel_diff']:.2e} (tolerance {c['tolerance']:g}): "
             + ("agrees" if c["ok"] else "DIFFERS" + ("" if c["finite"] else " (non-finite)"))
             for (model, dtype, rank), c in checks.items()]
    print("\n" + "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            options = {k: v for k, v in vars(args).items() if k != "func"}
            json.dump({"environment": env, "rows": rows, "options": options,
                       "checks": [dict(model=m, dtype=d, matrix_approximation_rank=r, **c)
                                  for (m, d, r), c in checks.items()]}, f, indent=1, default=str)
    return _history(args, rows, env)


def _history(args, rows, env) -> int:
    """Append the correct rows to the benchmark history and compare with ``--compare-to``; 0, or 2 for a bad ref."""
    from powersgd_triton import history as H

    path = None if args.no_history else (args.history or H.default_path())
    commit, dirty = H.git_commit()
    if path:
        good = [r for r in rows if r["agrees_with_pytorch"]]
        bad = sorted({f"{r['model']} r={r['matrix_approximation_rank']} {r['dtype']}" for r in rows
                      if not r["agrees_with_pytorch"]})
        if bad:
            print(f"not recorded in {path}: ours differs from PyTorch's hook for {', '.join(bad)}")
        if not commit:
            print(f"not recorded in {path}: no git commit here (run from a checkout)")
        elif good:
            n = H.append(path, H.make_records(good, source="bench", env=env, commit=commit, dirty=dirty),
                         correct=True)
            print(f"recorded {n} rows in {path} (commit {commit[:10]}{', dirty work tree' if dirty else ''}, "
                  f"device {H.device_name(env)})")
    if args.compare_to:
        try:
            records = H.load(path or H.DEFAULT_PATH)
            ref = H.resolve_ref(args.compare_to)
            device = H.device_name(env)
            cmp = H.compare(records, ref, commit, device)
        except (OSError, H.HistoryError) as exc:
            return _usage(f"--compare-to {args.compare_to}: {exc}")
        print("\n" + H.format_comparison(cmp, ref, commit or "?", device))
    return 0

