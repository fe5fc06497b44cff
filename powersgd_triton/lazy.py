"""Lazy package attributes (PEP 562), shared by :mod:`powersgd_triton` and :mod:`powersgd_triton.train`: a public
name is imported from the module that defines it on first use, and a submodule by its name, so importing the package
imports no torch (``powersgd-triton --help`` answers without it). Imports nothing itself."""

import importlib
from typing import Callable, Dict


def module_getattr(package: str, exports: Dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` (its ``__name__``): ``exports`` maps each public name to the module
    (relative to ``package``) that defines it; the value is kept in the package's namespace after the first lookup.
    Any other name that does not start with ``__`` is tried as a submodule. Raises ``AttributeError`` for a name that
    is neither (and re-raises a ``ModuleNotFoundError`` from inside an existing submodule)."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            setattr(importlib.import_module(package), name, value)
            return value
        if not name.startswith("__"):
            try:
                return importlib.import_module("." + name, package)
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
