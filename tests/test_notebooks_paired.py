"""Every notebook in notebooks/ is a jupytext percent-format .py (the source of truth, reviewed in diffs) paired
with an .ipynb that has the same cells (outputs ignored) and stores one complete run of them, outputs included
(regenerate with ``python notebooks/execute.py NN_name``, which runs the .py and writes the .ipynb).
"""

import glob
import json
import os

import pytest

jupytext = pytest.importorskip("jupytext")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
SOURCES = sorted(glob.glob(os.path.join(NOTEBOOKS, "[0-9][0-9]_*.py")))


def _cells(nb):
    return [(c["cell_type"], c["source"].rstrip("\n"), sorted(c.get("metadata", {}).get("tags", []))) for c in nb["cells"]]


EXPECTED = ("01_quickstart", "02_accuracy_vs_reference", "03_speed_vs_reference", "04_convergence", "05_autotuning",
            "06_fsdp_hsdp")


def test_the_notebooks_are_there():
    names = [os.path.basename(p)[:-3] for p in SOURCES]
    assert set(EXPECTED) <= set(names), sorted(set(EXPECTED) - set(names))


@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_py_and_ipynb_are_paired(source):
    with open(source) as f:
        text = f.read()
    assert "format_name: percent" in text and "formats: ipynb,py:percent" in text, "not a paired percent notebook"
    ipynb = source[:-3] + ".ipynb"
    name = os.path.basename(source)[:-3]
    assert os.path.exists(ipynb), f"{name}.ipynb missing: python notebooks/execute.py {name}"
    from_py = jupytext.reads(text, fmt="py:percent")
    with open(ipynb) as f:
        stored = json.load(f)
    stored_nb = jupytext.reads(json.dumps(stored), fmt="ipynb")
    assert _cells(from_py) == _cells(stored_nb), f"{name}.ipynb differs from its .py: python notebooks/execute.py {name}"
    assert stored["metadata"].get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_ipynb_stores_one_complete_run(source):
    """Every code cell executed, in order, in one kernel (execution counts 1, 2, 3, ...); no stored error; some
    output stored."""
    with open(source[:-3] + ".ipynb") as f:
        stored = json.load(f)
    code = [c for c in stored["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"execution counts {counts}: not one run top to bottom; python notebooks/execute.py {os.path.basename(source)[:-3]}")
    for i, cell in enumerate(code):
        kinds = [o.get("output_type") for o in cell.get("outputs", [])]
        assert "error" not in kinds, f"code cell {i + 1} stored an error"
    assert any(o.get("output_type") in ("stream", "display_data", "execute_result") for c in code
               for o in c.get("outputs", [])), "no output stored"
