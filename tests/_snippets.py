"""The Python blocks of the documentation (README.md, docs/**/*.md), found and run.

A fenced block whose info string is ``python`` runs; every block of one page runs in order in one namespace, in a
fresh interpreter set up as torchrun sets up one process of a one-rank job (``RANK=0``, ``WORLD_SIZE=1``,
``LOCAL_RANK=0``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), from a scratch folder as the working directory.
A block that cannot run here says why in an HTML comment on the line before its fence::

    <!-- snippet: skip (needs a GPU and 2 nodes) -->
    ```python
    ...
    ```

A skip needs its reason in parentheses; ``python`` blocks are the only ones run (``bash``, ``text`` are not).

Run one page by hand: ``python tests/_snippets.py docs/guides/ddp.md``.
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import List, Optional

from _deadline import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\s*(?:\((.*)\))?\s*-->\s*$")


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    skip: Optional[str]  # the reason, when the block is marked skip


def blocks(path: str) -> List[Block]:
    """Every fenced block of the markdown file ``path``; ``ValueError`` for an unclosed fence or a skip without a
    reason."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        skip = None
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0:
            s = SKIP.match(lines[j])
            if s:
                skip = (s.group(1) or "").strip()
                if not skip:
                    raise ValueError(f"{path}:{j + 1}: a skipped snippet needs its reason: <!-- snippet: skip (why) -->")
        k = i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence[0] * len(fence)):
            k += 1
        if k == len(lines):
            raise ValueError(f"{path}:{i + 1}: unclosed code fence")
        body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:k]]
        out.append(Block(path, i + 2, lang, "\n".join(body) + "\n", skip))
        i = k + 1
    return out


def doc_files(root: str = ROOT) -> List[str]:
    """README.md and every markdown file under docs/, sorted."""
    files = [os.path.join(root, "README.md")]
    for folder, _, names in os.walk(os.path.join(root, "docs")):
        files += [os.path.join(folder, n) for n in names if n.endswith(".md")]
    return sorted(files)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_page(path: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the ``python`` blocks of ``path`` (skips left out) in a fresh interpreter; its return code is 0 when all
    ran, 1 with ``<path>:<line>`` and the traceback on stderr when one raised."""
    todo = [b.__dict__ for b in blocks(path) if b.lang == "python" and b.skip is None]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("TRITON_INTERPRET", None)  # as a user's CPU run: our hooks take their torch backend
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([sys.executable, os.path.abspath(__file__), "--exec"], input=json.dumps(todo),
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=scaled(timeout))


def _exec_blocks(todo) -> int:
    namespace = {"__name__": "__snippet__"}
    for b in todo:
        try:
            exec(compile(b["code"], f"{b['path']}:{b['line']}", "exec"), namespace)
        except BaseException:  # noqa: B902 - SystemExit too: a snippet must not end the page
            print(f"snippet failed: {b['path']}:{b['line']}", file=sys.stderr)
            traceback.print_exc()
            return 1
        print(f"ran {b['path']}:{b['line']}")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            from powersgd_triton import teardown

            teardown.destroy_process_group()
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--exec"]:
        sys.exit(_exec_blocks(json.load(sys.stdin)))
    code = 0
    for page in sys.argv[1:] or doc_files():
        proc = run_page(os.path.abspath(page))
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        code = code or proc.returncode
    sys.exit(code)
