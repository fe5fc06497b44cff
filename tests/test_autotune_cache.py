"""The autotuner's JSON files on CPU: entries with a bad field set aside (the file kept intact, the valid entries
kept), shipped per-GPU files with a bad entry, concurrent writers (filelock, and the fcntl fallback without it). Moved
out of tests/test_autotune.py (rooms of at most 600 lines); every test gets its own cache folder
(``POWERSGD_TRITON_CACHE_DIR``), so the user's cache is never touched.
"""

import json
import os

import pytest

from powersgd_triton.autotune import cache as cache_mod
from powersgd_triton.autotune.cache import CacheWarning, ConfigCache
from powersgd_triton.autotune.keys import DeviceKey

from _dist import start_context

# Started from the fork server, as the multi-rank harness's ranks are (tests/_dist.py says why not a plain fork).
SPAWN = start_context()
pytestmark = pytest.mark.usefixtures("isolated_autotune")  # tests/conftest.py: a cache folder per test


GOOD_KEY = "project|bf16|r4|layerwise|n10|m10|w20"
BAD_ENTRIES = {
    "time_str": {"config": {"BLOCK_N": 64, "num_warps": 4}, "time_ms": "fast"},
    "time_nan": {"config": {"BLOCK_N": 64, "num_warps": 4}, "time_ms": float("nan")},
    "time_negative": {"config": {"BLOCK_N": 64, "num_warps": 4}, "heuristic_ms": -1.0},
    "time_bool": {"config": {"BLOCK_N": 64, "num_warps": 4}, "time_ms": True},
    "config_list": {"config": {"BLOCK_N": [64], "num_warps": 4}},
    "config_float": {"config": {"BLOCK_N": 64.5, "num_warps": 4}},
    "config_empty": {"config": {}},
    "candidates_str": {"config": {"BLOCK_N": 64, "num_warps": 4}, "candidates": "many"},
    "tuned_at_number": {"config": {"BLOCK_N": 64, "num_warps": 4}, "tuned_at": 20261130},
    "not_object": 5,
}


@pytest.mark.parametrize("bad", sorted(BAD_ENTRIES))
def test_cache_entry_with_bad_field_is_set_aside(tmp_path, monkeypatch, capsys, bad):
    """A well-formed file whose entry has e.g. ``"time_ms": "fast"``: `autotune --show` warns, sets the file aside
    (intact), keeps and shows the valid entries; it used to exit 1 with ``TypeError: must be real number``."""
    from powersgd_triton import cli

    folder = tmp_path / "user-cache"
    folder.mkdir()
    path = folder / "autotune-cache.json"
    good = {"config": {"BLOCK_N": 32, "num_warps": 4}, "time_ms": 0.25, "heuristic_ms": float("inf"),
            "candidates": 3, "tuned_at": "2026-11-30T00:00:00", "torch": "2.13.0"}
    bad_key = "project|bf16|r4|layerwise|n11|m11|w22"
    text = json.dumps({"format": 1, "devices": {"dev": {"device": {}, "entries": {GOOD_KEY: good,
                                                                                  bad_key: BAD_ENTRIES[bad]}}}})
    path.write_text(text)
    with pytest.warns(CacheWarning, match=f"1 invalid entries.*{bad_key.replace('|', '.')}"):
        assert cli.main(["autotune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "dev: 1 entries" in out and "0.2500" in out
    aside = [p for p in os.listdir(folder) if ".corrupt-" in p]
    assert len(aside) == 1 and (folder / aside[0]).read_text() == text  # the original, as it was
    kept = json.loads(path.read_text())["devices"]["dev"]["entries"]
    assert list(kept) == [GOOD_KEY] and kept[GOOD_KEY]["time_ms"] == 0.25
    # read again: nothing left to complain about
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error", CacheWarning)
        assert list(ConfigCache(str(folder)).load()["devices"]["dev"]["entries"]) == [GOOD_KEY]


def test_shipped_file_with_bad_entry_keeps_the_others(tmp_path):
    path = tmp_path / "h200.json"
    good = {"config": {"BLOCK_N": 32, "num_warps": 4}, "time_ms": 0.5}
    path.write_text(json.dumps({"format": 1, "device": {"gpu": "h200"},
                                "entries": {GOOD_KEY: good, "k2": {"config": {"BLOCK_N": 64}, "time_ms": "fast"}}}))
    with pytest.warns(CacheWarning, match="1 invalid entries.*k2: time_ms"):
        entries = cache_mod.load_device_file(str(path))
    assert entries == {GOOD_KEY: good}


def _writer(folder, wid, count, start, lock):
    if lock == "flock":  # without the filelock package: the fcntl fallback
        from powersgd_triton.compat import env as _env

        real = _env.optional_import
        _env.optional_import = lambda name: None if name == "filelock" else real(name)
        assert type(_env.file_lock(folder + "-probe.lock", 1.0)).__name__ == "_FlockLock"
    start.wait(30)
    cache = ConfigCache(folder)
    dk = DeviceKey("fake_gpu", "sm90", "3.9.0")
    for i in range(count):
        cache.put(dk, f"project|bf16|r4|layerwise|n{wid}|m{i}|w20", {"config": {"writer": wid, "i": i}})
    os._exit(0)


@pytest.mark.parametrize("lock", ["filelock", "flock"])
def test_concurrent_writers_keep_every_entry(tmp_path, lock):
    """4 processes x 12 writes at once; ``flock``: without the filelock package (the fcntl fallback)."""
    folder = str(tmp_path / "c")
    start = SPAWN.Event()
    procs = [SPAWN.Process(target=_writer, args=(folder, w, 12, start, lock)) for w in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = json.load(open(os.path.join(folder, "autotune-cache.json")))
    entries = data["devices"][DeviceKey("fake_gpu", "sm90", "3.9.0").key]["entries"]
    assert len(entries) == 48
    assert sorted(os.listdir(folder)) == ["autotune-cache.json", "autotune-cache.json.lock"]  # no temp files left
