"""The parser of ``powersgd-triton autotune``, built without torch; the command itself is
:func:`powersgd_triton.cli.autotune_run.run` (imported when it runs: it imports torch)."""

import argparse

from powersgd_triton.cli_common import RANK_HELP, add_rank_option, positive
from powersgd_triton.shapes import MODELS


def _run(args: argparse.Namespace) -> int:
    from powersgd_triton.cli import autotune_run

    return autotune_run.run(args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "autotune",
        help="tune the Triton kernels' block sizes for a model's gradient shapes on this GPU",
        description="Tune the shape classes of a model's gradients on this GPU (cached per GPU model), "
        "or show / clear the cache and the first-use verdicts.",
    )
    p.add_argument("--model", choices=sorted(MODELS), help="model whose gradient shapes are tuned")
    add_rank_option(p, type=positive(int), nargs="+", default=[4], metavar="R",
                    help=RANK_HELP + "; several may be given (default 4)")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=["fp32", "fp16", "bf16"], help="gradient dtype(s)")
    p.add_argument("--hook", choices=["layerwise", "batched", "both"], default="layerwise",
                   help="the layer-wise hooks' (layerwise) and/or the batched hook's shapes")
    p.add_argument("--bucket-cap-mb", type=positive(float), default=25.0, help="DDP bucket size (default 25)")
    p.add_argument("--first-bucket-mb", type=float, default=1.0,
                   help="DDP's smaller first bucket (default 1, DDP's default; 0: none)")
    p.add_argument("--min-compression-rate", type=positive(float), default=2.0,
                   help="PowerSGDState's min_compression_rate (default 2)")
    p.add_argument("--force", action="store_true", help="re-tune shape classes already cached")
    p.add_argument("--export", metavar="PATH", help="also write the results as a shipped-format <gpu>.json")
    p.add_argument("--warmup-ms", type=positive(float), default=25.0, help="do_bench warm-up per candidate (default 25)")
    p.add_argument("--rep-ms", type=positive(float), default=100.0,
                   help="do_bench measurement time per candidate (default 100)")
    p.add_argument("--show", action="store_true", help="print the cache and exit")
    p.add_argument("--clear", action="store_true", help="empty the cache")
    p.add_argument("--clear-verdicts", action="store_true",
                   help="forget the first-use verification's verdicts (verify-verdicts.json): every kernel is "
                   "checked again at its next first use")
    p.set_defaults(func=_run)
    return p
