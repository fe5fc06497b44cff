"""``powersgd-triton bench --link RATES``: the command. Checks, one launch of 2 ranks per rate and workload, the rows.

Three ways to run, chosen by the environment:

* ``--netns`` (root, iproute2): a :class:`~powersgd_triton.linkbench.netns.LinkPair` is made once; for each rate
  its limit is set and the two ranks are started, one in each namespace (``ip netns exec``), with
  ``GLOO_SOCKET_IFNAME`` set to their veth end and ``MASTER_ADDR`` to rank 0's veth address.
* under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set): this process is one rank;
  ``--link`` names the link the nodes have (one rate, a label); rank 0 prints and writes.
* neither: two ranks on this machine over the loopback (``--link unlimited`` only: a limit needs ``--netns``).

Every check (rates, root, iproute2, matplotlib for ``--plot``, the output folders, the workloads' data) happens
before anything starts. A rank that fails stops the other; Ctrl-C and SIGTERM stop both ranks and remove the
namespaces.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any, Dict, List, Optional

from powersgd_triton.linkbench import netns, report
from powersgd_triton.linkbench.names import ALLREDUCE, DEFAULT_STEPS, RESNET18, Spec
from powersgd_triton.linkbench.rates import Rate

PROG = "powersgd-triton bench"
BASE_PORT = 29500  # inside the namespaces nothing else listens; one port per launch (no TIME_WAIT reuse)


class RankFailed(RuntimeError):
    """A rank exited with an error, or the launch ran past its timeout; the message has the rank's last lines."""


def _error(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return code


def _check_path(option: str, path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{option} {path} is a directory; give a file name"
    if not os.path.isdir(folder):
        return f"{option} {path}: its folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{option} {path}: its folder {folder} is not writable"
    return None


def check(args, torchrun: bool) -> Optional[str]:
    """Why the ``--link`` command line cannot run here, in one line, or ``None``."""
    if getattr(args, "model_only", False) or getattr(args, "host_overhead", False):
        return "--link measures training steps: not with --model-only or --host-overhead"
    ranks = [r for r in str(args.matrix_approximation_ranks).split(",") if r]
    if len(ranks) != 1 or not ranks[0].isdigit() or int(ranks[0]) < 1:
        return ("--link takes one --matrix-approximation-ranks value (an integer >= 1), got "
                f"{args.matrix_approximation_ranks!r}")
    rates: List[Rate] = args.link
    if torchrun:
        if args.netns:
            return "--netns starts its own 2 ranks: not under torchrun"
        if len(rates) != 1:
            return "under torchrun --link names the one link the nodes have (e.g. --link 25gbit or unlimited)"
    elif args.netns:
        why = netns.refusal()
        if why:
            return why
        if args.device == "cuda":
            return "--netns runs its ranks on CPU (gloo over the veth pair); NCCL would bypass the link"
    elif any(r.limited for r in rates):
        return (f"--link {','.join(r.label for r in rates)}: a rate limit needs --netns (root, iproute2), which makes "
                "the link here; or run under torchrun on the nodes whose link you want to measure")
    if args.plot:
        why = report.plot_missing()
        if why:
            return why
    for option, path in (("--out", args.out), ("--plot", args.plot)):
        why = _check_path(option, path)
        if why:
            return why
    from powersgd_triton.train.data import DataUnavailable, check_available

    for w in args.workload:
        if w != RESNET18:  # generated data; the others read an installed package
            try:
                check_available(w)
            except DataUnavailable as exc:
                return f"--workload {w}: {exc}"
    return None


def _rank(args) -> int:
    return int(str(args.matrix_approximation_ranks).split(",")[0])


def _specs(args, rate: Rate, threads: Optional[int], device: str) -> List[Spec]:
    hooks = list(args.hooks)
    if ALLREDUCE not in hooks:
        hooks.insert(0, ALLREDUCE)  # the ratios are to it
    return [Spec(workload=w, hooks=hooks, rate=rate.label, steps=args.steps or DEFAULT_STEPS[w],
                 start_iter=args.start_iter, matrix_approximation_rank=_rank(args), batch_size=args.batch_size,
                 seed=args.seed, threads=threads, device=device, bucket_cap_mb=args.bucket_cap_mb)
            for w in args.workload]


def _stop(procs: List[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM each rank's process group (they were started in sessions of their own), SIGKILL after ``grace``."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no output)"


def launch_pair(spec: Spec, link: Optional[netns.LinkPair], port: int, timeout: float) -> Dict[str, Any]:
    """Start 2 ranks of ``spec`` (in ``link``'s namespaces, or on 127.0.0.1), wait, return rank 0's result.
    Raises :class:`RankFailed`; the ranks are stopped whatever happens (also on ``KeyboardInterrupt``)."""
    with tempfile.TemporaryDirectory(prefix="powersgd-link-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "rank0.json")
        with open(spec_path, "w") as f:
            f.write(spec.to_json())
        procs, logs = [], []
        try:
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR=link.addresses[0] if link else "127.0.0.1", MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME=link.veths[rank] if link else "lo")
                if spec.threads:
                    env["OMP_NUM_THREADS"] = str(spec.threads)
                argv = [sys.executable, "-m", "powersgd_triton.linkbench.ranks", spec_path, out_path]
                logs.append(os.path.join(tmp, f"rank{rank}.log"))
                with open(logs[-1], "w") as log:
                    procs.append(subprocess.Popen(link.command(rank, argv) if link else argv, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                for rank, p in enumerate(procs):
                    if p.poll() not in (None, 0):
                        raise RankFailed(f"rank {rank} of {spec.workload} at {spec.rate} exited with {p.returncode}:\n"
                                         + _tail(logs[rank]))
                if time.monotonic() > deadline:
                    raise RankFailed(f"{spec.workload} at {spec.rate} did not finish within {timeout:g} s "
                                     "(--link-timeout); its ranks were stopped")
                time.sleep(0.2)
            for rank, p in enumerate(procs):
                if p.returncode != 0:
                    raise RankFailed(f"rank {rank} of {spec.workload} at {spec.rate} exited with {p.returncode}:\n"
                                     + _tail(logs[rank]))
        finally:
            _stop(procs)
        import json

        with open(out_path) as f:
            return json.load(f)


def _progress(res: Dict[str, Any], load: List[float]) -> str:
    from powersgd_triton.linkbench.report import percentile

    parts = [f"{h} {percentile(v['step_ms'], 50):.1f}" for h, v in res["hooks"].items()]
    return (f"{res['rate']:>10} {res['workload']}: median ms/step " + ", ".join(parts)
            + f"  (load {load[0]:.1f} -> {load[1]:.1f})")


def _environment(results: List[Dict[str, Any]], loads: List[List[float]], args, mode: str) -> Dict[str, Any]:
    env = dict(results[0].get("environment", {})) if results else {}
    env.pop("load_avg", None)
    flat = [x for pair in loads for x in pair]
    env.update(mode=mode, world_size=results[0]["world_size"] if results else None,
               matrix_approximation_rank=_rank(args),
               start_powerSGD_iter=args.start_iter, seed=args.seed,
               load_1min_min=min(flat) if flat else None, load_1min_max=max(flat) if flat else None,
               workloads={r["workload"]: {"batch_size_per_rank": r.get("batch_size"),
                                          "timed_steps": r.get("timed_steps")} for r in results})
    return env


def _finish(args, results: List[Dict[str, Any]], loads: List[List[float]], mode: str) -> int:
    rows = report.make_rows(results)
    env = _environment(results, loads, args, mode)
    head = (f"{env.get('date')}; {env.get('cpu')} ({env.get('cpus_usable')} CPUs usable), torch {env.get('torch')}; "
            f"{mode}; {env['world_size']} ranks; rank {env['matrix_approximation_rank']}, compression from step "
            f"{args.start_iter}; 1-min load {env['load_1min_min']:.1f}-{env['load_1min_max']:.1f}")
    print("\n" + head + "\n\n" + report.format_table(rows))
    for workload, line in report.summary(rows):
        print(f"{workload}: {line}")
    if args.out:
        report.write_json(args.out, rows, env)
        print(f"rows written to {args.out}")
    if args.plot:
        report.plot(args.plot, rows, title=head)
        print(f"chart written to {args.plot}")
    return 0


def run(args) -> int:
    """The ``bench --link`` command: 0 when every rate was measured, 1 when a rank failed, 2 for a refused command
    line, 130 when interrupted."""
    from powersgd_triton.train import launch

    try:
        tr = launch.torchrun_env()
    except launch.LaunchError as exc:
        return _error(str(exc))
    why = check(args, tr is not None)
    if why:
        return _error(why)
    rates: List[Rate] = args.link
    if tr is not None:
        from powersgd_triton.linkbench.ranks import measure

        device = "cuda" if args.device in ("cuda", "auto") and _cuda() else "cpu"
        results, loads = [], []
        for spec in _specs(args, rates[0], args.threads, device):
            before = list(os.getloadavg())[:1]
            res = measure(spec)
            loads.append(before + list(os.getloadavg())[:1])
            if res is not None:
                results.append(res)
                print(_progress(res, loads[-1]), flush=True)
        return _finish(args, results, loads, f"torchrun, link {rates[0].label}") if tr.rank == 0 else 0
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // 2)
    mode = "two network namespaces, veth + tc tbf on each end" if args.netns else "two local ranks over loopback"
    print(f"{PROG} --link: {', '.join(r.label for r in rates)}; {', '.join(args.workload)}; {mode}; "
          f"{threads} thread(s) per rank", flush=True)
    results, loads = [], []
    try:
        with ExitStack() as stack:
            link = stack.enter_context(netns.LinkPair()) if args.netns else None
            port = BASE_PORT
            for rate in rates:
                if link is not None:
                    link.set_rate(rate)
                for spec in _specs(args, rate, threads, "cpu"):
                    port += 1
                    before = os.getloadavg()[0]
                    res = launch_pair(spec, link, port if link else launch.free_port(), args.link_timeout)
                    loads.append([before, os.getloadavg()[0]])
                    results.append(res)
                    print(_progress(res, loads[-1]), flush=True)
    except RankFailed as exc:
        return _error(str(exc), 1)
    except netns.NetnsError as exc:
        return _error(str(exc), 1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the ranks were stopped"
              + (" and the namespaces removed" if args.netns else ""), file=sys.stderr, flush=True)
        return 130
    return _finish(args, results, loads, mode)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()

