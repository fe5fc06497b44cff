"""powersgd_triton.history: benchmark rows as JSON lines keyed by git commit and device, correctness-gated, compared
between two refs."""

import json
import subprocess
from pathlib import Path

import pytest

from powersgd_triton import history as H

ROOT = Path(__file__).resolve().parents[1]
ENV = {"cpu": "Test CPU", "cpus_usable": 2, "torch": "2.13.0", "triton": "3.9.0", "load_avg": [0.5, 0.5, 0.5]}
GPU_ENV = {**ENV, "gpu": "NVIDIA H200"}


def _rows(ms, launches=4):
    return [dict(model="resnet50", matrix_approximation_rank=4, dtype="float32", impl="ours", ops_backend="triton",
                 median_ms=ms, triton_launches=launches, held_bytes=1000, agrees_with_pytorch=True, note="x"),
            dict(model="resnet50", matrix_approximation_rank=4, dtype="float32", impl="pytorch", median_ms=2 * ms)]


def test_records_append_and_load(tmp_path):
    path = tmp_path / "sub" / "h.jsonl"
    recs = H.make_records(_rows(1.5), source="bench", env=GPU_ENV, commit="a" * 40, dirty=False)
    assert H.append(str(path), recs, correct=True) == 2
    back = H.load(str(path))
    assert back == json.loads(json.dumps(recs))
    r = back[0]
    assert r["device"] == "cuda: NVIDIA H200" and r["commit"] == "a" * 40 and r["source"] == "bench"
    assert r["key"] == {"model": "resnet50", "matrix_approximation_rank": 4, "dtype": "float32", "impl": "ours",
                        "ops_backend": "triton"}
    assert r["metrics"] == {"median_ms": 1.5, "triton_launches": 4, "held_bytes": 1000}  # bools and text left out
    assert H.make_records(_rows(1.0), source="bench", env=ENV, commit="b" * 40, dirty=True)[0]["device"] == \
        "cpu: Test CPU x2"


def test_append_is_correctness_gated(tmp_path):
    path = tmp_path / "h.jsonl"
    recs = H.make_records(_rows(1.0), source="bench", env=ENV, commit="a" * 40, dirty=False)
    with pytest.raises(ValueError, match="correctness check failed.*ours differs"):
        H.append(str(path), recs, correct=False, why="ours differs")
    assert not path.exists()
    no_commit = H.make_records(_rows(1.0), source="bench", env=ENV, commit=None, dirty=False)
    with pytest.raises(ValueError, match="no git commit"):
        H.append(str(path), no_commit, correct=True)
    assert not path.exists()


@pytest.mark.parametrize("line, message", [("{not json\n", "h.jsonl:2: not JSON"),
                                           ('{"format": 9}\n', "h.jsonl:2: not a history record"),
                                           ('[1, 2]\n', "h.jsonl:2: not a history record")])
def test_damaged_history_is_named(tmp_path, line, message):
    path = tmp_path / "h.jsonl"
    H.append(str(path), H.make_records(_rows(1.0)[:1], source="bench", env=ENV, commit="a" * 40, dirty=False),
             correct=True)
    with open(path, "a") as f:
        f.write(line)
    with pytest.raises(H.HistoryError, match=message):
        H.load(str(path))


def test_compare_two_commits_on_one_device(tmp_path):
    path = str(tmp_path / "h.jsonl")
    old, new = "1" * 40, "2" * 40
    for commit, env, ms in ((old, ENV, 4.0), (old, ENV, 5.0), (old, GPU_ENV, 0.1), (new, ENV, 2.5)):
        H.append(path, H.make_records(_rows(ms), source="bench", env=env, commit=commit, dirty=False), correct=True)
    records = H.load(path)
    rows = H.compare(records, old[:7], device="cpu: Test CPU x2")  # a prefix; the newest commit by default
    by = {(r["key"]["impl"], r["metric"]): r for r in rows}
    assert by["ours", "median_ms"]["ref"] == 5.0 and by["ours", "median_ms"]["new"] == 2.5  # the newer line wins
    assert by["ours", "median_ms"]["ratio"] == pytest.approx(0.5)
    assert by["pytorch", "median_ms"]["ratio"] == pytest.approx(0.5)
    assert by["ours", "triton_launches"]["ratio"] == 1.0
    text = H.format_comparison(rows, old, new, "cpu: Test CPU x2")
    assert "| bench | model=resnet50, matrix_approximation_rank=4, dtype=float32, impl=ours" in text
    with pytest.raises(H.HistoryError, match="no record at commit 2222222222.. on device 'cuda: NVIDIA H200'"):
        H.compare(records, old, new, device="cuda: NVIDIA H200")
    with pytest.raises(H.HistoryError, match="no record at commit 3333"):
        H.compare(records, "3" * 40)


def test_refs_resolve_through_git_and_the_cli_compares(tmp_path, capsys):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    head = head.stdout.strip()
    assert H.resolve_ref("HEAD", str(ROOT)) == head and H.git_commit(str(ROOT))[0] == head
    with pytest.raises(H.HistoryError, match="'no-such-ref-xyz' is not a commit"):
        H.resolve_ref("no-such-ref-xyz", str(ROOT))
    path = str(tmp_path / "h.jsonl")
    for commit, ms in (("9" * 40, 3.0), (head, 1.5)):
        H.append(path, H.make_records(_rows(ms), source="bench", env=ENV, commit=commit, dirty=False), correct=True)
    assert H.main(["--path", path, "--ref", "9" * 40]) == 0
    out = capsys.readouterr().out
    assert f"history: {head[:10]} against 9999999999" in out and "| 3 | 1.5 | 0.500 |" in out
    assert H.main(["--path", path, "--ref", "no-such-ref-xyz"]) == 2
    assert "is not a commit" in capsys.readouterr().err
    assert H.main(["--path", str(tmp_path / "none.jsonl"), "--ref", "9" * 40]) == 2  # a fresh clone has no history
    assert "no benchmark history at" in capsys.readouterr().err
