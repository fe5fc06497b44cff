"""``powersgd-triton autotune``: tune the shape classes of a model's gradients, show or clear the cache (the
command; its parser, built without torch, is :mod:`powersgd_triton.cli.autotune`).

::

    powersgd-triton autotune --model resnet50|bert-base|gpt2|vit-b16 [--matrix-approximation-rank R ...]
                             [--dtype D ...]
                             [--hook layerwise|batched|both] [--bucket-cap-mb MB] [--force] [--export PATH]
    powersgd-triton autotune --show     (the cache, candidates the tuner dropped and why, the hooks' verdicts)
    powersgd-triton autotune --clear
    powersgd-triton autotune --clear-verdicts   (the hooks' first-use verdicts: checked again at next use)

The model's gradient shapes come from :mod:`powersgd_triton.shapes` (no download), split into DDP-like buckets; every
distinct shape class of the four kernels is tuned once (progress bar on stderr) and a table is printed: chosen
config, its time, the heuristic's time and the speed-up, and per (dtype, rank, hook) the summed kernel time of one
step over all buckets. Results go to the user cache; ``--export PATH`` also writes them as a shipped-format
``<gpu>.json`` (PATH a file or a folder; an existing file of the same GPU is merged), which is how
``powersgd_triton/autotune/configs/`` is filled. Without CUDA or under ``TRITON_INTERPRET=1`` nothing is timed: the
table shows the configs that would be used, and says so.
"""

import math
import sys
from typing import Dict, List, Optional, Tuple

import torch

from powersgd_triton.autotune.cache import ConfigCache, export_device_file
from powersgd_triton.autotune.tuner import KERNELS, Choice, Tuner
from powersgd_triton.benchmarking import model_bucket_layouts
from powersgd_triton.cli_common import text_table
from powersgd_triton.compat import env as _env
from powersgd_triton.keys import DTYPE_NAMES, ShapeClass, parse_dtype, shape_class
from powersgd_triton.layout import BucketLayout
from powersgd_triton.ops.verify import candidate_gate, store

HOOKS = ("layerwise", "batched")


def make_tuner(args) -> Tuner:
    """The tuner the command uses (a seam for tests): each candidate is checked against the torch backend
    (:func:`powersgd_triton.ops.verify.candidate_gate`) before its time counts."""
    return Tuner(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, gate=candidate_gate)


def model_layouts(
    model: str,
    rank: int,
    dtype: torch.dtype,
    hook: str,
    device,
    bucket_cap_mb: float = 25.0,
    min_compression_rate: float = 2.0,
    first_bucket_mb: float = 1.0,
) -> List[BucketLayout]:
    """Bucket layouts of ``model``'s gradients as DDP would bucket them (``hook``: layerwise or batched); see
    :func:`powersgd_triton.benchmarking.model_bucket_layouts`, which builds them."""
    return model_bucket_layouts(model, rank, dtype, device, batched=hook == "batched", bucket_cap_mb=bucket_cap_mb,
                                first_bucket_mb=first_bucket_mb, min_compression_rate=min_compression_rate)


def format_config(cfg: dict) -> str:
    """Compact form: ``N64 K32 dot w4 s2`` (tile rows/cols, K step, tl.dot (``bf16-split``: project_t's split
    tensor-core dots), warps, stages)."""
    parts = []
    for key, tag in (("BLOCK_N", "N"), ("BLOCK_M", "M"), ("BLOCK", "B"), ("BLOCK_K", "K")):
        if key in cfg:
            parts.append(f"{tag}{cfg[key]}")
    if "USE_DOT" in cfg:
        parts.append("dot" if cfg["USE_DOT"] else "bcast")
    if cfg.get("SPLIT_BF16"):
        parts.append("bf16-split")
    parts.append(f"w{cfg.get('num_warps', 4)}")
    parts.append(f"s{cfg.get('num_stages', 1)}")
    return " ".join(parts)


def _ms(t: Optional[float]) -> str:
    return "-" if t is None or not math.isfinite(t) else f"{t:.4f}"


def _class_cells(sc: ShapeClass) -> List[str]:
    return [sc.kernel, sc.dtype, str(sc.rank), "batched" if sc.batched else "layerwise", str(sc.n), str(sc.m),
            str(sc.work)]


CLASS_HEADERS = ["kernel", "dtype", "R", "hook", "log2 n", "log2 m", "log2 work"]


def _show(out) -> int:
    cache = ConfigCache()
    devices = list(cache.devices())
    print(f"autotune cache: {cache.path}", file=out)
    if not devices:
        print("(empty)", file=out)
    for dkey, dev in devices:
        print(f"\n{dkey}: {len(dev['entries'])} entries", file=out)
        rows = []
        for key, e in sorted(dev["entries"].items()):
            try:
                cells = _class_cells(ShapeClass.parse(key))
            except ValueError:
                cells = [key] + [""] * (len(CLASS_HEADERS) - 1)
            h, t = e.get("heuristic_ms"), e.get("time_ms")
            speed = f"{h / t:.2f}x" if h and t and math.isfinite(h) and math.isfinite(t) else "-"
            rows.append(cells + [format_config(e["config"]), _ms(t), _ms(h), speed, str(e.get("tuned_at", ""))])
        print(text_table(CLASS_HEADERS + ["config", "ms", "heuristic ms", "speed-up", "tuned at"], rows), file=out)
        for key, e in sorted(dev["entries"].items()):
            for r in e.get("rejected") or ():
                if isinstance(r, dict):
                    print(f"  rejected for {key}: {format_config(r.get('config') or {})}: {r.get('why')}", file=out)
    _show_verdicts(out)
    return 0


def _show_verdicts(out) -> None:
    """The hooks' first-use verdicts (:mod:`powersgd_triton.ops.verify`), per device: kernel, shape class, config."""
    verdicts = store()
    devices = sorted(verdicts.load(refresh=True)["devices"].items())
    print(f"\nfirst-use verdicts: {verdicts.path}", file=out)
    if not devices:
        print("(none)", file=out)
    for dkey, dev in devices:
        print(f"\n{dkey}: {len(dev['verdicts'])} verdicts", file=out)
        rows = []
        for key, e in sorted(dev["verdicts"].items()):
            try:
                cells = _class_cells(ShapeClass.parse(key.split("|{", 1)[0]))
            except ValueError:
                cells = [key] + [""] * (len(CLASS_HEADERS) - 1)
            worst = e.get("worst")
            rows.append(cells + [format_config(e["config"]) if e["config"] else "-", "ok" if e["ok"] else "WRONG",
                                 "-" if worst is None else f"{worst:.2g}", str(e.get("detail") or ""),
                                 str(e.get("checked_at", ""))])
        print(text_table(CLASS_HEADERS + ["config", "verdict", "worst rel. error", "detail", "checked at"], rows),
              file=out)


def run(args, out=None) -> int:
    out = out or sys.stdout
    failed = False
    for flag, what, target in (("clear", "entries", ConfigCache), ("clear_verdicts", "verdicts", store)):
        if getattr(args, flag):
            holder = target()
            n = holder.clear()  # None: the folder is not usable (the warning above says why)
            if n is None:
                failed = True
                print(f"{what} not cleared: {holder.directory} is not a usable folder (see the warning above)",
                      file=sys.stderr)
            else:
                print(f"cleared {n} {what} from {holder.path}", file=out)
    if failed:
        return 1
    if args.show:
        return _show(out)
    if args.model is None:
        if args.clear or args.clear_verdicts:
            return 0
        print("powersgd-triton autotune: --model is required (or --show / --clear / --clear-verdicts)", file=sys.stderr)
        return 2
    tqdm = _env.progress_bar()

    tuner = make_tuner(args)
    cuda = torch.cuda.is_available() and not _env.interpreter_enabled()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    can_time, reason = tuner.timing_available(device)
    dk = tuner.device_key(device)
    hooks = HOOKS if args.hook == "both" else (args.hook,)
    print(f"powersgd-triton autotune: model {args.model} on {dk.gpu} ({dk.capability}, triton {dk.triton})", file=out)
    if not can_time:
        print(f"no timing: {reason}; showing the configs that would be used (heuristic unless cached)", file=out)

    # Every (dtype, rank, hook) group: its layouts, and one representative layout per new shape class.
    groups: List[Tuple[str, int, str, List[BucketLayout]]] = []
    work: Dict[str, Tuple[str, BucketLayout, torch.dtype]] = {}
    for dname in args.dtype:
        dtype = parse_dtype(dname)
        for rank in args.matrix_approximation_rank:
            for hook in hooks:
                layouts = model_layouts(args.model, rank, dtype, hook, device, args.bucket_cap_mb,
                                        args.min_compression_rate, args.first_bucket_mb)
                layouts = [lay for lay in layouts if lay.num_matrices > 0]
                groups.append((DTYPE_NAMES[dtype], rank, hook, layouts))
                for lay in layouts:
                    for k in KERNELS:
                        work.setdefault(shape_class(k, lay, dtype).key, (k, lay, dtype))

    choices: Dict[str, Choice] = {}
    by_layout: Dict[int, List[str]] = {}
    for key, (k, lay, dtype) in work.items():
        by_layout.setdefault(id(lay), []).append(key)
    with tqdm(total=len(work), desc=f"autotune {args.model}", unit="class", disable=None, file=sys.stderr) as bar:
        with tuner.session():
            for keys in by_layout.values():
                for key in keys:
                    k, lay, dtype = work[key]
                    bar.set_postfix_str(f"{k} {key.split('|', 2)[-1]}")
                    choices[key] = tuner.choose(k, lay, dtype, autotune=can_time, force=args.force and can_time)
                    bar.update(1)

    rows = []
    for key, c in choices.items():
        speed = f"{c.speedup:.2f}x" if c.speedup else "-"
        rows.append(_class_cells(c.shape_class) + [format_config(c.config), _ms(c.time_ms), _ms(c.heuristic_ms),
                                                    speed, c.source])
    print(text_table(CLASS_HEADERS + ["config", "ms", "heuristic ms", "speed-up", "source"], rows), file=out)

    # One step of the hook = the four kernels once per bucket.
    summary = []
    for dname, rank, hook, layouts in groups:
        tuned = heur = 0.0
        complete = True
        for lay in layouts:
            for k in KERNELS:
                c = choices[shape_class(k, lay, parse_dtype(dname)).key]
                if c.time_ms is None or c.heuristic_ms is None:
                    complete = False
                else:
                    tuned += c.time_ms
                    heur += c.heuristic_ms
        if complete and layouts and tuned > 0:
            summary.append([dname, str(rank), hook, str(len(layouts)), f"{heur:.4f}", f"{tuned:.4f}",
                            f"{heur / tuned:.2f}x"])
    if summary:
        print("\nper step (4 kernels x buckets, summed):", file=out)
        print(text_table(["dtype", "approx. rank", "hook", "buckets", "heuristic ms", "chosen ms", "speed-up"], summary),
              file=out)

    if args.export:
        measured = {key: c.entry() for key, c in choices.items()
                    if c.source in ("tuned", "cache", "shipped") and c.time_ms is not None}
        if not measured:
            print("nothing measured on this device: not exporting", file=out)
            return 1
        extra = {"name": torch.cuda.get_device_name(device) if cuda else dk.gpu}
        if cuda:
            extra["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
        extra["torch"] = torch.__version__
        path = export_device_file(args.export, dk, measured, extra)
        print(f"exported {len(measured)} entries to {path}", file=out)
    return 0
