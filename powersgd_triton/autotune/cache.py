"""The autotuner's persistent JSON cache, and the shipped per-GPU default files.

User cache: one file, ``autotune-cache.json``, in ``$POWERSGD_TRITON_CACHE_DIR`` or the user cache directory
(``platformdirs.user_cache_dir("powersgd_triton")``, e.g. ``~/.cache/powersgd_triton``; without platformdirs
``$XDG_CACHE_HOME/powersgd_triton`` or ``~/.cache/powersgd_triton``)::

    {"format": 1,
     "devices": {"<device key>": {"device": {"gpu": ..., "capability": ..., "triton": ..., "library": ...},
                                  "entries": {"<shape class key>": {"config": {...}, "time_ms": ...,
                                                                    "heuristic_ms": ..., ...}}}}}

Every write takes a file lock (``autotune-cache.json.lock``, :mod:`filelock`; without it ``fcntl.flock`` on POSIX,
else no lock: see :func:`powersgd_triton.compat.env.file_lock`), re-reads the file, merges its entries
and replaces the file atomically (temporary file in the same folder, ``fsync``, ``os.replace``): eight ranks of a
node writing at once never lose an entry or leave half a file. A file that cannot be parsed or has the wrong
structure gives a :class:`CacheWarning`, is renamed aside (``*.corrupt-<time>-<pid>``) and the cache starts empty;
a folder that cannot be written gives a warning and the cache lives in memory only. Each entry is checked on read
(:func:`entry_problem`: config values, times, counts); a file with invalid entries is set aside the same way, with a
warning naming them, and its valid entries are written back. Nothing here raises on bad files or folders.

Shipped defaults: ``powersgd_triton/autotune/configs/<gpu>.json`` (and ``$POWERSGD_TRITON_CONFIG_DIR`` first), one
file per normalized GPU model, holding one device section (``{"format": 1, "device": {...}, "entries": {...}}``),
written by ``powersgd-triton autotune --export``. A GPU uses the file named after it, else the longest file name that
is a run of its words (``h200.json`` serves ``h200_nvl``).
"""

import json
import os
import time
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

from powersgd_triton.compat import env as _env
from powersgd_triton.cache_files import CacheWarning, atomic_write_json, default_cache_dir  # noqa: F401 - re-exported
from powersgd_triton.keys import DeviceKey, name_matches

FORMAT = 1
CACHE_FILENAME = "autotune-cache.json"
PACKAGE_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def default_config_dirs() -> List[str]:
    """Folders searched for shipped-format ``<gpu>.json`` files: ``$POWERSGD_TRITON_CONFIG_DIR``, then the package's."""
    dirs = []
    env = os.environ.get("POWERSGD_TRITON_CONFIG_DIR")
    if env:
        dirs.append(os.path.expanduser(env))
    dirs.append(PACKAGE_CONFIG_DIR)
    return dirs


_CONFIG_VALUE = (bool, int, str)
_OPTIONAL_STR = ("tuned_at", "torch")


def _is_time(v) -> bool:
    """A stored time in ms: None, or a number >= 0 (``inf``: the candidate failed), never a bool or NaN."""
    if v is None:
        return True
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0  # NaN >= 0 is False


def entry_problem(entry) -> Optional[str]:
    """Why ``entry`` is not a valid cache / shipped entry, or None when it is.

    Valid: a dict whose ``config`` is a non-empty dict of str -> bool/int/str, whose ``time_ms`` and ``heuristic_ms``
    (if present) are None or numbers >= 0, ``candidates`` (if present) an int >= 0, ``tuned_at`` and ``torch``
    (if present) strings. Other fields are kept and not read.
    """
    if not isinstance(entry, dict):
        return f"not an object ({type(entry).__name__})"
    cfg = entry.get("config")
    if not isinstance(cfg, dict) or not cfg:
        return "config is not a non-empty object"
    for k, v in cfg.items():
        if not isinstance(k, str) or not isinstance(v, _CONFIG_VALUE):
            return f"config value {k!r}: {v!r} is not a bool, int or string"
    for k in ("time_ms", "heuristic_ms"):
        if k in entry and not _is_time(entry[k]):
            return f"{k} is {entry[k]!r}, not a number of milliseconds"
    c = entry.get("candidates", 0)
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        return f"candidates is {c!r}, not a count"
    for k in _OPTIONAL_STR:
        if k in entry and not isinstance(entry[k], str):
            return f"{k} is {entry[k]!r}, not a string"
    return None


def _valid_cache(data) -> bool:
    """The file's structure (entries are checked one by one: :func:`_split_bad_entries`)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("devices"), dict):
        return False
    return all(isinstance(d, dict) and isinstance(d.get("entries"), dict) for d in data["devices"].values())


def _valid_device_file(data) -> bool:
    return (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("device"), dict)
        and isinstance(data.get("entries"), dict)
    )


def _split_bad_entries(entries: dict) -> Tuple[dict, List[str]]:
    """``(valid entries, ["<key>: <problem>", ...])``."""
    good, bad = {}, []
    for k, e in entries.items():
        why = entry_problem(e)
        if why is None:
            good[k] = e
        else:
            bad.append(f"{k}: {why}")
    return good, bad


def _drop_bad_entries(data: dict) -> List[str]:
    """Remove invalid entries from a structurally valid cache, in place; returns what was removed and why."""
    bad = []
    for dkey, dev in data["devices"].items():
        dev["entries"], b = _split_bad_entries(dev["entries"])
        bad += [f"{dkey} / {x}" for x in b]
    return bad


def _set_aside(path: str, reason: str, what: str = "is unreadable", then: str = "tuning starts again") -> None:
    aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        os.replace(path, aside)
        where = f"moved to {aside}"
    except OSError as exc:
        where = f"could not be moved aside ({exc})"
    warnings.warn(
        f"powersgd_triton autotune cache {path} {what} ({reason}); it was {where} and {then}",
        CacheWarning,
        stacklevel=3,
    )


class ConfigCache:
    """The user's JSON cache (see module docstring). ``directory`` defaults to :func:`default_cache_dir`."""

    def __init__(self, directory: Optional[str] = None, lock_timeout: float = 60.0):
        self.directory = os.path.abspath(directory if directory is not None else default_cache_dir())
        self.path = os.path.join(self.directory, CACHE_FILENAME)
        self.lock_timeout = lock_timeout
        self._data: Optional[dict] = None  # last state read from or written to disk
        self._writable = True

    # ------------------------------------------------------------------ file access
    def _lock(self):
        os.makedirs(self.directory, exist_ok=True)
        return _env.file_lock(self.path + ".lock", self.lock_timeout)

    def _read_locked(self) -> dict:
        """Read the file (caller holds the lock); a corrupt file is set aside and an empty cache returned."""
        empty = {"format": FORMAT, "devices": {}}
        try:
            with open(self.path, "r") as f:
                text = f.read()
        except FileNotFoundError:
            return empty
        except (OSError, UnicodeDecodeError) as exc:
            _set_aside(self.path, f"{type(exc).__name__}: {exc}")
            return empty
        try:
            data = json.loads(text)
        except ValueError as exc:
            _set_aside(self.path, f"invalid JSON: {exc}")
            return empty
        if not _valid_cache(data):
            _set_aside(self.path, f"not a format-{FORMAT} autotune cache")
            return empty
        bad = _drop_bad_entries(data)
        if bad:  # the file moves aside as it was; its valid entries are written back
            shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
            _set_aside(self.path, f"{len(bad)} invalid entries: {shown}", what="has unreadable entries",
                       then="its valid entries were written back")
            try:
                atomic_write_json(self.path, data)
            except OSError:
                pass  # kept in memory; the next write tries again
        return data

    def load(self, refresh: bool = False) -> dict:
        """The whole cache (read once, then from memory unless ``refresh``). Never raises on bad files."""
        if self._data is not None and not refresh:
            return self._data
        try:
            with self._lock():
                self._data = self._read_locked()
        except Exception as exc:  # lock timeout, unwritable folder: read without the lock
            self._warn_unwritable(exc)
            try:
                with open(self.path) as f:
                    data = json.load(f)
                self._data = data if _valid_cache(data) else {"format": FORMAT, "devices": {}}
                bad = _drop_bad_entries(self._data)
                if bad:
                    warnings.warn(f"powersgd_triton autotune cache {self.path}: {len(bad)} invalid entries ignored "
                                  f"({'; '.join(bad[:3])})", CacheWarning, stacklevel=2)
            except Exception:
                self._data = {"format": FORMAT, "devices": {}}
        return self._data

    def _warn_unwritable(self, exc: BaseException) -> None:
        if self._writable:
            warnings.warn(
                f"powersgd_triton autotune cache folder {self.directory} is not usable ({type(exc).__name__}: {exc});"
                " tuned configs are kept in memory only",
                CacheWarning,
                stacklevel=4,
            )
        self._writable = False

    def entries(self, device: DeviceKey) -> Dict[str, dict]:
        """``{shape class key: entry}`` stored for ``device`` (empty dict if none)."""
        dev = self.load()["devices"].get(device.key)
        return dev["entries"] if dev else {}

    def put_many(self, device: DeviceKey, entries: Dict[str, dict]) -> bool:
        """Merge ``entries`` into the file under ``device`` (lock, re-read, atomic replace). False if not persisted."""
        if not entries:
            return True
        try:
            with self._lock():
                data = self._read_locked()
                dev = data["devices"].setdefault(device.key, {"device": device.as_dict(), "entries": {}})
                dev["device"] = device.as_dict()
                dev["entries"].update(entries)
                atomic_write_json(self.path, data)
                self._data = data
            return True
        except Exception as exc:
            self._warn_unwritable(exc)
            data = self._data if self._data is not None else {"format": FORMAT, "devices": {}}
            dev = data["devices"].setdefault(device.key, {"device": device.as_dict(), "entries": {}})
            dev["entries"].update(entries)
            self._data = data
            return False

    def put(self, device: DeviceKey, shape_key: str, entry: dict) -> bool:
        return self.put_many(device, {shape_key: entry})

    def clear(self) -> Optional[int]:
        """Remove the cache file; returns the number of entries it held, or None when the folder could not be used
        (a :class:`CacheWarning` says why; nothing was removed). Raises nothing."""
        try:
            with self._lock():
                count = sum(len(d["entries"]) for d in self._read_locked()["devices"].values())
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        except Exception as exc:
            self._warn_unwritable(exc)
            count = None
        self._data = {"format": FORMAT, "devices": {}}
        return count

    def devices(self) -> Iterable[Tuple[str, dict]]:
        """``(device key, {"device": ..., "entries": ...})`` pairs, sorted by key."""
        return sorted(self.load(refresh=True)["devices"].items())


# ---------------------------------------------------------------------------------------------- shipped files
def find_device_file(gpu: str, dirs: Optional[Iterable[str]] = None) -> Optional[str]:
    """Path of the shipped-format file for normalized GPU name ``gpu``: ``<gpu>.json`` in the first folder having it,
    else the longest ``<tag>.json`` whose tag is a run of ``gpu``'s words. None if there is none."""
    dirs = list(default_config_dirs() if dirs is None else dirs)
    for d in dirs:
        exact = os.path.join(d, f"{gpu}.json")
        if os.path.isfile(exact):
            return exact
    best: Optional[Tuple[int, str]] = None
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            if not name.endswith(".json"):
                continue
            tag = name[: -len(".json")]
            if name_matches(tag, gpu) and (best is None or len(tag) > best[0]):
                best = (len(tag), os.path.join(d, name))
    return best[1] if best else None


def load_device_file(path: str) -> Dict[str, dict]:
    """Entries of a shipped-format file; a bad file gives a :class:`CacheWarning` and no entries."""
    try:
        with open(path) as f:
            data = json.load(f)
    except Exception as exc:
        warnings.warn(f"shipped autotune configs {path} unreadable ({exc}); ignored", CacheWarning, stacklevel=2)
        return {}
    if not _valid_device_file(data):
        warnings.warn(f"shipped autotune configs {path} have the wrong structure; ignored", CacheWarning, stacklevel=2)
        return {}
    good, bad = _split_bad_entries(data["entries"])
    if bad:
        warnings.warn(f"shipped autotune configs {path}: {len(bad)} invalid entries ignored ({'; '.join(bad[:3])})",
                      CacheWarning, stacklevel=2)
    return good


def export_device_file(path: str, device: DeviceKey, entries: Dict[str, dict], extra: Optional[dict] = None) -> str:
    """Write (or merge into) a shipped-format file for ``device``; ``path`` may be a folder (``<gpu>.json``).

    Existing entries of a file for the same GPU are kept unless replaced, so tuning several models accumulates.
    Returns the path written.
    """
    if os.path.isdir(path) or path.endswith(os.sep):
        path = os.path.join(path, f"{device.gpu}.json")
    merged: Dict[str, dict] = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                old = json.load(f)
            if _valid_device_file(old) and old["device"].get("gpu") == device.gpu:
                merged.update(_split_bad_entries(old["entries"])[0])
        except Exception:
            pass
    merged.update(entries)
    info = device.as_dict()
    info.update(extra or {})
    atomic_write_json(path, {"format": FORMAT, "device": info, "entries": merged})
    return path
