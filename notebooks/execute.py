"""Execute the notebooks and store them with their outputs: ``python notebooks/execute.py [NN_name ...]``.

For each ``notebooks/NN_name.py`` (jupytext percent format, the reviewed source) this builds the notebook from the
``.py``, runs it top to bottom in a ``python3`` Jupyter kernel (nbclient, working folder ``notebooks/``) and writes
``NN_name.ipynb`` with its outputs, so a reader browsing the repository sees the tables and plots. The cells are the
``.py``'s (``tests/test_notebooks_paired.py`` checks the pairing, ignoring outputs). The notebooks write their key
figures to ``notebooks/figures/*.png`` (linked from the README) because this script sets ``POWERSGD_NB_FIGURES``;
CI's nbmake run leaves both the ``.ipynb`` and the figures as they are.

Runs with this Python's kernel, the checkout first on ``PYTHONPATH``, without ``TRITON_INTERPRET`` (03 sets it for
its launch counts), at the default size for a 2-core CPU (``POWERSGD_NB_FULL=1`` in the environment: the long runs).
A failing cell stops the run with the cell's error; the ``.ipynb`` of that notebook is left as it was.
"""

import argparse
import glob
import hashlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def execute(source: str, timeout: float = 1800.0) -> float:
    """Run ``source`` (an ``NN_name.py``) and write its ``.ipynb`` with outputs; the seconds it took."""
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(source)
    for i, cell in enumerate(nb.cells):  # stable ids (nbformat draws random ones): a rerun changes only outputs
        cell.id = hashlib.sha1(f"{i}:{cell.cell_type}:{cell.source}".encode()).hexdigest()[:8]
    nb.metadata.setdefault("kernelspec", {"display_name": "Python 3", "language": "python", "name": "python3"})
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": HERE}}).execute()
    seconds = time.perf_counter() - t0
    target = source[:-3] + ".ipynb"
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        f.write(jupytext.writes(nb, fmt="ipynb"))
    os.replace(tmp, target)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python notebooks/execute.py", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="notebooks to run (e.g. 04_convergence); default: all")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per cell")
    args = p.parse_args(argv)
    sources = sorted(glob.glob(os.path.join(HERE, "[0-9][0-9]_*.py")))
    if args.names:
        wanted = {os.path.splitext(os.path.basename(n))[0] for n in args.names}
        unknown = wanted - {os.path.basename(s)[:-3] for s in sources}
        if unknown:
            print(f"no such notebook: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        sources = [s for s in sources if os.path.basename(s)[:-3] in wanted]
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    os.environ["POWERSGD_NB_FIGURES"] = os.path.join(HERE, "figures")
    for source in sources:
        seconds = execute(source, args.timeout)
        print(f"{os.path.basename(source)[:-3]}.ipynb: executed in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
