"""Run tests/_exit_checkpoint.py many times and count the ranks that abort at exit (issue 40 item 5).

    python tests/_exit_loop.py RUNS [--teardown torch,ours] [--hook ours|pytorch|none] [--launcher direct|torchrun|fork]

``--teardown`` takes a comma-separated list, used in turn run after run (same conditions for each). Launchers:
``direct`` (default) starts the 2 ranks as 2 ``python`` processes with torchrun's environment variables; ``torchrun``
runs ``python -m torch.distributed.run --standalone --nproc-per-node 2`` (as issue 40 did; its agent is one more
process); ``fork`` forks the ranks from this process, torch imported once, each rank running the script with
``runpy`` and ending through finalization (fast, but it reproduced no abort: the unwinding after the script's last
line hands the GIL over). A run aborts when a rank dies of a signal or exits non-zero, or its output has "terminate
called"; the summary: ``TEARDOWN: runs N aborts A trained T`` per teardown.
"""

import argparse
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_exit_checkpoint.py")
_KEEP = []  # the ranks' script globals: alive until finalization, as a script's __main__ globals are


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, folder, script_args):
    """In the forked child: run the script as rank ``rank``, then end through finalization (SystemExit)."""
    err = os.open(os.path.join(folder, f"err{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    out = os.open(os.path.join(folder, f"out{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.dup2(out, 1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [SCRIPT, "--dir", os.path.join(folder, "ck"), *script_args]
    _KEEP.append(runpy.run_path(SCRIPT, run_name="__main__"))
    sys.stdout.flush()
    raise SystemExit(0)


def _forked_run(folder, script_args):
    port = _free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _rank(rank, port, folder, script_args)  # never returns
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    text = "".join(open(os.path.join(folder, f"{k}{r}")).read() for k in ("err", "out") for r in range(2))
    return statuses, text


def _direct(folder, script_args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--dir", os.path.join(folder, "ck"), *script_args],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return [p.returncode for p in procs], "".join(outs)


def _torchrun(folder, script_args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           SCRIPT, "--dir", os.path.join(folder, "ck"), *script_args],
                          capture_output=True, text=True, env=env, timeout=600)
    return [proc.returncode], proc.stdout + proc.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=int)
    ap.add_argument("--teardown", default="torch")
    ap.add_argument("--hook", default="ours")
    ap.add_argument("--launcher", choices=("direct", "torchrun", "fork"), default="direct")
    args = ap.parse_args()
    teardowns = args.teardown.split(",")
    if args.launcher == "fork":
        import torch  # noqa: F401 - imported once, before the forks

        torch.set_num_threads(1)
        import torch.distributed  # noqa: F401
        import torch.nn.parallel  # noqa: F401
        import torch._dynamo  # noqa: F401 - DDP imports it on first use
        import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook  # noqa: F401
        import powersgd_triton.checkpoint  # noqa: F401
        import powersgd_triton.teardown  # noqa: F401
        from powersgd_triton import PowerSGDState, powerSGD_hook  # noqa: F401 - the lazy imports, done once
    launch = {"direct": _direct, "torchrun": _torchrun, "fork": _forked_run}[args.launcher]
    counts = {t: [0, 0, 0] for t in teardowns}  # runs, aborts, trained

    def summary():
        return "; ".join(f"{t}: runs {n} aborts {a} trained {k}" for t, (n, a, k) in counts.items())

    for i in range(args.runs):
        teardown = teardowns[i % len(teardowns)]
        folder = tempfile.mkdtemp(prefix="exit-loop-")  # no context manager: a forked rank unwinds through here
        statuses, text = launch(folder, ["--teardown", teardown, "--hook", args.hook])
        shutil.rmtree(folder, ignore_errors=True)
        if args.launcher == "fork":
            bad = any(os.WIFSIGNALED(s) or os.WEXITSTATUS(s) != 0 for s in statuses)
        else:
            bad = any(s != 0 for s in statuses)
        abort = bad or "terminate called" in text
        counts[teardown][0] += 1
        counts[teardown][1] += abort
        counts[teardown][2] += "trained" in text
        if abort:
            print(f"run {i} ({teardown}): exit {statuses}\n{text[-1500:]}", flush=True)
        if (i + 1) % 10 == 0:
            print(f"after {i + 1}: {summary()}", flush=True)
    print(summary(), flush=True)


if __name__ == "__main__":
    main()
