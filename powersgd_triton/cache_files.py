"""The package's files in the user cache folder: where that folder is, how a file there is written, what a damaged
one raises.

The autotuner's cache (:mod:`powersgd_triton.autotune.cache`) and the first-use verdicts
(:mod:`powersgd_triton.ops.verify`) both live here; this module imports nothing of the package but
:mod:`powersgd_triton.compat.env`, so both may use it without depending on each other.
"""

import json
import os
import tempfile

from powersgd_triton.compat import env as _env


class CacheWarning(UserWarning):
    """A cache or shipped config file could not be read or written; the tuner carries on without it."""


def default_cache_dir() -> str:
    """``$POWERSGD_TRITON_CACHE_DIR``, else the user cache dir for ``powersgd_triton`` (platformdirs' when installed,
    else ``$XDG_CACHE_HOME/powersgd_triton`` or ``~/.cache/powersgd_triton``)."""
    env = os.environ.get("POWERSGD_TRITON_CACHE_DIR")
    if env:
        return os.path.expanduser(env)
    return _env.user_cache_dir("powersgd_triton")


def atomic_write_json(path: str, data, sort_keys: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file in the same folder + ``os.replace``); the
    temporary file is removed if writing fails."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=sort_keys)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
