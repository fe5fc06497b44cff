"""The architecture contract: ``lint-imports`` (import-linter, ``[tool.importlinter]`` in pyproject.toml) keeps every
contract, and it does catch what it is there to catch (a copy of the package with one bad import fails it); module
names and sizes.

The contracts: hooks above state above ops (layers), ops never imports hooks or state, nothing in the package
imports the repository's ``tools/``, no import cycle between the modules and folders of any folder of the package.
"""

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "powersgd_triton")
MAX_LINES = 600

# lint-imports' own entry point, run by this interpreter (the venv's import-linter, whatever PATH holds)
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint_imports(cwd: str) -> subprocess.CompletedProcess:
    """``lint-imports --no-cache pyproject.toml`` in ``cwd``, with ``cwd`` first on the import path (so the package
    analysed is ``cwd``'s ``powersgd_triton``, not the installed one)."""
    env = dict(os.environ, PYTHONPATH=cwd + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(LINT + ["--no-cache", "--no-logo", os.path.join(cwd, "pyproject.toml")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_contract_is_kept():
    run = lint_imports(ROOT)
    assert run.returncode == 0, f"lint-imports failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout, run.stdout


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the package (and pyproject.toml, tools/) in a temporary folder, for one deliberate bad import."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, tmp_path / "powersgd_triton", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "tools"), tmp_path / "tools", ignore=ignore)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(path, line: str) -> None:
    with open(path, "a") as f:
        f.write(f"\n{line}  # the deliberate bad import of tests/test_architecture.py\n")


def test_ops_importing_hooks_breaks_the_contract(package_copy):
    _add_import(package_copy / "powersgd_triton" / "ops" / "reference.py", "import powersgd_triton.hooks")
    run = lint_imports(str(package_copy))
    assert run.returncode != 0, run.stdout
    assert "powersgd_triton.ops.reference -> powersgd_triton.hooks" in run.stdout, run.stdout
    assert "hooks above state above ops BROKEN" in run.stdout, run.stdout


def test_an_import_cycle_breaks_the_contract(package_copy):
    # layout is below everything (ops, state, hooks, benchmarking, train import it): importing train closes cycles
    _add_import(package_copy / "powersgd_triton" / "layout.py", "import powersgd_triton.train")
    run = lint_imports(str(package_copy))
    assert run.returncode != 0, run.stdout
    assert "no import cycle: between the modules and folders of every folder of the package BROKEN" in run.stdout
    assert "No cycles are allowed in powersgd_triton." in run.stdout, run.stdout
    assert ".layout -> .train" in run.stdout or ".train ->" in run.stdout, run.stdout


def _modules():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_top_level_module_names_are_public():
    private = [n for n in os.listdir(PACKAGE) if n.endswith(".py") and n.startswith("_")
               and n not in ("__init__.py", "__main__.py")]
    private += [n for n in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, n)) and n.startswith("_")
                and n != "__pycache__"]
    assert not private, f"modules directly under powersgd_triton/ named with a leading underscore: {private}"


def test_no_module_over_the_line_limit():
    long = {}
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[os.path.relpath(path, ROOT)] = n
    assert not long, f"modules over {MAX_LINES} lines (split them by what they hold): {long}"


def test_the_package_does_not_import_tools():
    """The forbidden contract says so through import-linter; this reads the sources too (``tools`` is outside the
    package, so import-linter sees it only as an external name)."""
    # the two listed in pyproject's ignore_imports
    allowed = {os.path.join("powersgd_triton", "perfmodel.py"), os.path.join("powersgd_triton", "cli", "bench.py")}
    found = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n == "tools" or n.startswith("tools.") for n in names):
                rel = os.path.relpath(path, ROOT)
                if rel not in allowed:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"the package imports the repository's tools/: {found}"


def test_public_objects_name_their_public_modules():
    """The moved public objects keep the module paths users, pickles, DDP's logging and the train command's metrics
    name them by (the re-seat moved their code, not their names)."""
    import pickle

    import powersgd_triton as P
    from powersgd_triton import wrappers

    assert P.PowerSGDState.__module__ == "powersgd_triton.state"
    assert P.powerSGD_hook.__module__ == P.batched_powerSGD_hook.__module__ == "powersgd_triton.hooks"
    assert P.alternating_powerSGD_hook.__module__ == "powersgd_triton.alternating"
    assert wrappers.bf16_compress_wrapper.__module__ == wrappers.fp16_compress_wrapper.__module__ \
        == "powersgd_triton.wrappers"
    blob = pickle.dumps((P.PowerSGDState(None, matrix_approximation_rank=3), P.powerSGD_hook,
                         P.alternating_powerSGD_hook))
    assert b"powersgd_triton.state.powersgd_state" not in blob and b"powersgd_triton.hooks.layerwise" not in blob
    state, hook, alternating = pickle.loads(blob)
    assert type(state) is P.PowerSGDState and state.matrix_approximation_rank == 3
    assert hook is P.powerSGD_hook and alternating is P.alternating_powerSGD_hook


def test_the_performance_model_finds_the_checkout_tools_from_anywhere(tmp_path):
    """``powersgd-triton bench --model-only`` compiles with the repository's tools/ (not installed): found beside the
    package whatever the current directory and ``sys.path`` (a console script does not put the checkout on it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys; from powersgd_triton import perfmodel; a, c = perfmodel.checkout_tools(); "
            "print(a.__file__); print(c.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    files = [os.path.realpath(f) for f in proc.stdout.split()]
    tools = os.path.realpath(os.path.join(ROOT, "tools"))
    assert files == [os.path.join(tools, "aot.py"), os.path.join(tools, "aot_compile.py")], files
