#!/usr/bin/env python3
"""ONE command for a GPU run of powersgd_triton (the sections live in ``bench/gpucheck/``, one room each).

    PYTHONPATH=. python bench/gpu_check.py --quick      # on the GPU machine, from a bare checkout
    PYTHONPATH=. python bench/gpu_check.py              # the full run
    PYTHONPATH=. python bench/gpu_check.py --dry-run    # CPU + Triton interpreter, tiny shapes (the CI smoke test)

Needs only torch, triton and numpy. What each section does, the budgets and the outputs: ``bench/gpucheck/__init__.py``.
"""

import faulthandler
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):  # gpucheck (next to this file) and powersgd_triton (the checkout)
    if path not in sys.path:
        sys.path.insert(0, path)

from gpucheck.main import main  # noqa: E402 - parses the arguments, sets TRITON_INTERPRET for --dry-run

if __name__ == "__main__":
    code = main()
    faulthandler.cancel_dump_traceback_later()
    sys.exit(code)
