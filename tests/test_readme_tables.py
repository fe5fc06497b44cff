"""README tables: the marker/table machinery of ``tools.readme_tables``, and the README's digits table
reproduced by a fresh ``powersgd-triton train --compare`` (same seed, same machine type: the same accuracy, loss,
bytes and calls as printed; on another CPU type accuracy and loss within a tolerance; ms/step not compared)."""

import os

import pytest
import torch

from _deadline import scaled

from tools import readme_tables as RT
from powersgd_triton.cli import text_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
HEAD = ["hook", "final test acc", "test loss", "ms/step", "all-reduced/step/rank", "PyTorch/ours"]


def _random_table(rng, rows=3):
    vals = torch.rand(rows, 4, generator=rng, dtype=torch.float64).tolist()
    body = [[f"hook{i}", f"{v[0]:.4f}", f"{v[1]:.4f}", f"{100 * v[2]:.1f}", f"{1000 * v[3]:.1f} KiB", f"{v[2]:.2f}x"]
            for i, v in enumerate(vals)]
    return text_table(HEAD, body).split("\n"), body


def _bump(cell):
    """A cell printed differently: its last digit changed."""
    return cell[:-1] + ("1" if cell[-1] != "1" else "2") if cell[-1].isdigit() else cell + "0"


def test_find_tables_reads_markers_tables_and_empty_slots(rng):
    table, _ = _random_table(rng)
    text = "\n".join(["# title", "<!-- readme-table check: powersgd-triton train --compare -->", ""] + table
                     + ["", "text", "<!-- readme-table regenerate: python -m powersgd_triton bench --rounds 3 -->",
                        "more text", "<!-- not a marker -->", "| a | b |", "|---|---|"])
    found = RT.find_tables(text)
    assert [(t.mode, t.command) for t in found] == [("check", "powersgd-triton train --compare"),
                                                     ("regenerate", "python -m powersgd_triton bench --rounds 3")]
    assert found[0].lines == table and (found[0].start, found[0].end) == (3, 3 + len(table))
    assert found[1].lines == [] and found[1].start == found[1].end == found[1].marker_line + 1


def test_extract_table_takes_the_first_table_of_the_output(rng):
    table, _ = _random_table(rng)
    other, _ = _random_table(rng, rows=1)
    out = "\n".join(["title line", ""] + table + ["", "* a note"] + other)
    assert RT.extract_table(out) == table


def test_compare_ignores_only_timing_columns(rng):
    table, body = _random_table(rng)
    assert RT.timing_columns(HEAD) == [3, 5]
    assert RT.compare_tables(table, table) == []
    r = int(torch.randint(len(body), (1,), generator=rng))
    timed = [row[:] for row in body]
    timed[r][3], timed[r][5] = _bump(timed[r][3]), _bump(timed[r][5])
    assert RT.compare_tables(table, text_table(HEAD, timed).split("\n")) == []
    for c in (1, 2, 4):  # accuracy, loss, bytes: compared as printed
        changed = [row[:] for row in body]
        changed[r][c] = _bump(changed[r][c])
        diffs = RT.compare_tables(table, text_table(HEAD, changed).split("\n"))
        assert diffs == [f"row {r + 1} ({body[r][0]}), column {HEAD[c]!r}: README {body[r][c]} vs fresh {changed[r][c]}"]
    renamed = text_table(HEAD[:2] + ["loss"] + HEAD[3:], body).split("\n")
    assert RT.compare_tables(table, renamed)[0].startswith("columns differ")
    fewer = text_table(HEAD, body[:-1]).split("\n")
    assert RT.compare_tables(table, fewer) == [f"README has {len(body)} rows, the fresh run {len(body) - 1}"]


def test_only_this_projects_commands_run():
    import sys

    assert RT.command_argv("powersgd-triton train --compare a,b") == [sys.executable, "-m", "powersgd_triton",
                                                                       "train", "--compare", "a,b"]
    assert RT.command_argv("python -m powersgd_triton bench --rounds 3")[:3] == [sys.executable, "-m",
                                                                                 "powersgd_triton"]
    for bad in ("rm -rf /", "python -c 'print(1)'", "python -m pip install x", "bash -c 'powersgd-triton'"):
        with pytest.raises(RT.ReadmeTableError, match="only powersgd-triton"):
            RT.command_argv(bad)
    env = RT.command_env()
    assert "TRITON_INTERPRET" not in env and env["PYTHONPATH"].split(os.pathsep)[0] == ROOT


def test_write_replaces_and_inserts_tables_and_check_reports(tmp_path, rng, monkeypatch):
    old, _ = _random_table(rng)
    new_a, _ = _random_table(rng, rows=4)
    new_b, _ = _random_table(rng, rows=2)
    fresh = {"powersgd-triton train --compare": new_a, "python -m powersgd_triton bench": new_b}
    monkeypatch.setattr(RT, "run_command", lambda command, cwd, timeout=None, extra=(): (fresh[command], 0.5))
    path = tmp_path / "README.md"
    path.write_text("\n".join(["intro", "<!-- readme-table check: powersgd-triton train --compare -->", ""] + old
                              + ["", "between", "<!-- readme-table regenerate: python -m powersgd_triton bench -->",
                                 "after"]))
    times = RT.write(str(path), log=lambda *a: None)
    assert times == {"powersgd-triton train --compare": 0.5, "python -m powersgd_triton bench": 0.5}
    expected = (["intro", f"<!-- readme-tables machine: {RT.machine()} -->",
                 "<!-- readme-table check: powersgd-triton train --compare -->", ""] + new_a
                + ["", "between", "<!-- readme-table regenerate: python -m powersgd_triton bench -->"] + new_b
                + ["", "after"])
    assert path.read_text().split("\n") == expected
    logged = []
    assert RT.check(str(path), log=logged.append) == []  # the regenerate table is skipped, and says so
    assert any(line.startswith("not checked") and "bench" in line for line in logged)
    fresh["powersgd-triton train --compare"] = new_a[:-1]
    assert RT.check(str(path), log=lambda *a: None) == [
        f"line 3: powersgd-triton train --compare: README has {len(new_a) - 2} rows, the fresh run {len(new_a) - 3}"]
    with pytest.raises(RT.ReadmeTableError, match="no marked table"):
        RT.check(str(path), only="charlm")


def test_another_machine_type_compares_accuracy_and_loss_within_tolerance(tmp_path, rng, monkeypatch):
    head = ["hook", "final test acc", "test loss", "ms/step", "all-reduced/step/rank"]
    vals = torch.rand(3, 3, generator=rng, dtype=torch.float64).tolist()
    body = [[f"hook{i}", f"{0.5 + 0.4 * a:.4f}", f"{0.05 + b:.4f}", f"{100 * c:.1f}", f"{1 + 9 * c:.1f} KiB"]
            for i, (a, b, c) in enumerate(vals)]
    table = text_table(head, body).split("\n")
    r = int(torch.randint(3, (1,), generator=rng))

    def changed(col, value):
        rows = [row[:] for row in body]
        rows[r][col] = value
        return text_table(head, rows).split("\n")

    acc, loss = float(body[r][1]), float(body[r][2])
    near = [changed(1, f"{acc + 0.015:.4f}"), changed(2, f"{loss * 1.1:.4f}")]
    far = [changed(1, f"{acc - 0.03:.4f}"), changed(2, f"{loss * 1.2:.4f}"), changed(4, "99.9 KiB")]
    for fresh in near:
        assert RT.compare_tables(table, fresh, tolerant=True) == [] and len(RT.compare_tables(table, fresh)) == 1
    for fresh in far:
        assert len(RT.compare_tables(table, fresh, tolerant=True)) == 1

    # check() is exact on the recorded machine type, tolerant (and says so) on another one
    command = "powersgd-triton train --compare"
    path = tmp_path / "README.md"
    path.write_text("\n".join([f"<!-- readme-tables machine: {RT.machine()} -->",
                               f"<!-- readme-table check: {command} -->"] + table))
    monkeypatch.setattr(RT, "run_command", lambda c, cwd, timeout=None, extra=(): (near[0], 0.1))
    assert len(RT.check(str(path), log=lambda *a: None)) == 1
    path.write_text(path.read_text().replace(RT.machine(), "x86_64 GenuineIntel family 6 model 143, torch 2.13.0"))
    logged = []
    assert RT.check(str(path), log=logged.append) == []
    assert "GenuineIntel" in logged[0] and logged[-1].startswith("agrees within the other-machine tolerance")
    monkeypatch.setattr(RT, "run_command", lambda c, cwd, timeout=None, extra=(): (far[0], 0.1))
    assert len(RT.check(str(path), log=lambda *a: None)) == 1


def test_cpu_runs_pin_the_math_libraries_unless_the_user_set_them():
    from powersgd_triton.train import launch

    assert launch.cpu_numerics_env({}) == launch.CPU_NUMERICS_ENV
    mine = {"MKL_CBWR": "AUTO", "PATH": "/bin"}
    pins = launch.cpu_numerics_env(mine)
    assert "MKL_CBWR" not in pins and set(pins) == set(launch.CPU_NUMERICS_ENV) - {"MKL_CBWR"}
    with pytest.raises(launch.LaunchError, match="forkserver"):
        launch.launch(print, 1, env={"MKL_CBWR": "AUTO"}, start_method="fork")


def test_readme_tables_are_marked_filled_and_runnable():
    """README.md and the docs pages: every marked table filled and runnable here; each file with check tables records
    its machine; the README keeps the digits table; a command marked in two places has the same table in both."""
    files = RT.marked_files(ROOT)
    assert files[0] == README and any(f.endswith(os.path.join("docs", "benchmarks.md")) for f in files), files
    by_command = {}
    for path in files:
        with open(path) as f:
            text = f.read()
        tables = RT.find_tables(text)
        if any(t.mode == "check" for t in tables):
            assert RT.recorded_machine(text), f"{path}: no readme-tables machine line (readme_tables --write)"
        for t in tables:
            RT.command_argv(t.command)  # runnable here
            assert t.lines, f"{path} {t.label}: no table (python -m tools.readme_tables --write)"
            if t.mode == "check":
                head, _ = RT.parse_table(t.lines)
                assert len(RT.timing_columns(head)) < len(head) - 1
                if t.command in by_command:
                    assert RT.compare_tables(by_command[t.command], t.lines) == [], (path, t.label)
                by_command[t.command] = t.lines
        if path == README:
            assert "powersgd-triton train --workload digits --compare" in [t.command for t in tables]


def test_files_are_found_and_a_command_marked_twice_runs_once(tmp_path, rng, monkeypatch):
    """``marked_files``: README first, then the docs pages with a marker (not the others); ``write``/``check`` with a
    shared cache run a command marked in two files once and write its table to both; commands run from the
    checkout's root (the folder with pyproject.toml), also for a page under docs/."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    marker = "<!-- readme-table check: powersgd-triton train --compare -->"
    (tmp_path / "README.md").write_text(f"# r\n{marker}\n")
    (tmp_path / "docs" / "guides" / "b.md").write_text(f"text\n\n{marker}\n\nafter\n")
    (tmp_path / "docs" / "plain.md").write_text("no tables here\n")
    files = RT.marked_files(str(tmp_path))
    assert files == [str(tmp_path / "README.md"), str(tmp_path / "docs" / "guides" / "b.md")]
    table, _ = _random_table(rng)
    calls = []

    def fake(command, cwd, timeout=None, extra=()):
        calls.append((command, cwd))
        return table, 0.25

    monkeypatch.setattr(RT, "run_command", fake)
    cache = {}
    for path in files:
        RT.write(path, log=lambda *a: None, cache=cache)
    assert calls == [("powersgd-triton train --compare", str(tmp_path))]
    for path in files:
        assert [t.lines for t in RT.find_tables(open(path).read())] == [table]
        assert RT.check(path, log=lambda *a: None, cache=cache) == []
    assert len(calls) == 1
    assert RT.main(["--list", "--file", files[1]]) == 0


@pytest.mark.slow
def test_readme_digits_table_reproduces():
    """The digits table, wherever it is marked (README.md, docs/benchmarks.md), against one fresh
    ``powersgd-triton train --workload digits --compare`` (4 hooks, 2 gloo ranks, about a minute on 2 cores). A
    difference means the training numbers changed: regenerate the tables
    (``python -m tools.readme_tables --write``) and say why in the commit."""
    only = "--workload digits --compare"
    files = [f for f in RT.marked_files(ROOT) if RT.select(RT.find_tables(open(f).read()), only)]
    assert files[0] == README and len(files) >= 2, files
    cache, logged, diffs = {}, [], []
    for path in files:
        diffs += RT.check(path, only=only, timeout=scaled(600), log=logged.append, cache=cache)
    assert len(cache) == 1 and diffs == [], "\n".join(logged + diffs)
    verdicts = [line for line in logged if line.startswith(("agrees", "DIFFERS"))]
    assert len(verdicts) == len(files) and all(v.startswith("agrees") for v in verdicts), logged
