"""The keys the autotuner's cache and the first-use verdicts are filed under: a bucket layout's shape class, and
the device it runs on (re-exported by :mod:`powersgd_triton.autotune.keys`).

A tuned config is remembered per (device key, shape class):

* :class:`DeviceKey`: normalized GPU model name (``torch.cuda.get_device_name()``, or ``POWERSGD_TRITON_GPU_NAME``),
  compute capability, Triton version and library version (with a hash of the kernel sources). Two GPU models never
  share an entry, and an upgrade of Triton or of this library, or an edit of a kernel, starts from fresh entries
  (block sizes tuned for one version can be slow on another).
* :class:`ShapeClass`: kernel, gradient dtype, padded rank ``R`` (the constexpr the kernel is compiled with),
  layer-wise or batched, and log2 size classes. For the streaming kernels (``project``, ``project_t``,
  ``reconstruct``) the sizes are the typical row count ``n`` and column count ``m`` (medians weighted by matrix size:
  what most of the bytes see) and the total number of compressed elements (``work``). ``orthogonalize`` runs one
  program per matrix, so its time is set by the largest factor: ``n``/``m`` are the largest row/column counts and
  ``work`` is the number of matrices.

Size classes are ``round(log2(x))``: layouts within a factor of about 1.4 of each other share a class, so a model's
buckets need only a few tuning runs and a tuned entry serves similar models.
"""

import functools
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from powersgd_triton import __version__
from powersgd_triton.layout import BucketLayout, padded_rank

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
DTYPES_BY_NAME.update({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16})
STREAMING_KERNELS = ("project", "project_t", "reconstruct")


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (also accepts the short or long name). Raises ``ValueError`` if unknown."""
    if isinstance(dtype, str):
        if dtype in DTYPES_BY_NAME:
            return DTYPE_NAMES[DTYPES_BY_NAME[dtype]]
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES_BY_NAME)}")
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported gradient dtype {dtype}") from None


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"``/``"bfloat16"`` -> ``torch.bfloat16``. Raises ``ValueError`` if unknown."""
    try:
        return DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES_BY_NAME)}") from None


def size_class(x: int) -> int:
    """``round(log2(x))`` for ``x >= 1`` (0 for ``x <= 1``)."""
    return int(round(math.log2(x))) if x > 1 else 0


def _weighted_median(values: Sequence[int], weights: Sequence[int]) -> int:
    pairs = sorted(zip(values, weights))
    half = sum(weights) / 2.0
    acc = 0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0] if pairs else 0


@dataclass(frozen=True)
class ShapeClass:
    """What a tuned config is valid for (see module docstring). ``key`` is its string form in the JSON files."""

    kernel: str
    dtype: str  # "fp32" | "fp16" | "bf16"
    rank: int  # padded rank R (power of two)
    batched: bool
    n: int  # log2 class of rows (typical, or largest for orthogonalize)
    m: int  # log2 class of columns (typical, or largest for orthogonalize)
    work: int  # log2 class of compressed elements (number of matrices for orthogonalize)

    @property
    def key(self) -> str:
        kind = "batched" if self.batched else "layerwise"
        return f"{self.kernel}|{self.dtype}|r{self.rank}|{kind}|n{self.n}|m{self.m}|w{self.work}"

    @classmethod
    def parse(cls, key: str) -> "ShapeClass":
        """Inverse of :attr:`key`. Raises ``ValueError`` on a malformed key."""
        match = re.fullmatch(r"(\w+)\|(\w+)\|r(\d+)\|(batched|layerwise)\|n(\d+)\|m(\d+)\|w(\d+)", key)
        if match is None:
            raise ValueError(f"malformed shape class key {key!r}")
        k, dt, r, kind, n, m, w = match.groups()
        return cls(k, dt, int(r), kind == "batched", int(n), int(m), int(w))

    def same_family(self, other: "ShapeClass") -> bool:
        """Same kernel, dtype, rank and hook kind: sizes are the only difference (nearest-class lookup)."""
        return (self.kernel, self.dtype, self.rank, self.batched) == (
            other.kernel,
            other.dtype,
            other.rank,
            other.batched,
        )

    def distance(self, other: "ShapeClass") -> int:
        """L1 distance of the size classes (only meaningful within a family)."""
        return abs(self.n - other.n) + abs(self.m - other.m) + abs(self.work - other.work)

    def __str__(self) -> str:
        return self.key


def shape_class(kernel: str, layout: BucketLayout, dtype) -> ShapeClass:
    """The shape class of ``kernel`` launched on ``layout`` with gradients of ``dtype``."""
    mats = layout.matrices
    rank = padded_rank(layout.max_rank)
    dt = dtype_name(dtype)
    if not mats:
        return ShapeClass(kernel, dt, rank, layout.batched, 0, 0, 0)
    if kernel == "orthogonalize":
        n = max(s.n for s in mats)
        m = max(s.m for s in mats)
        work = len(mats)
    else:
        weights = [s.numel for s in mats]
        n = _weighted_median([s.n for s in mats], weights)
        m = _weighted_median([s.m for s in mats], weights)
        work = sum(weights)
    return ShapeClass(kernel, dt, rank, layout.batched, size_class(n), size_class(m), size_class(work))


# ------------------------------------------------------------------------------------------------ device key
def normalize_gpu_name(name: str) -> str:
    """File-name-safe GPU model: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100_80gb_hbm3"``, ``"NVIDIA H200"`` -> ``"h200"``.

    Lower case, vendor prefixes (``nvidia``, ``geforce``, ``amd``) dropped, runs of other characters -> ``_``.
    """
    s = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    parts = [p for p in s.split("_") if p]
    while parts and parts[0] in ("nvidia", "geforce", "amd", "tesla"):
        parts.pop(0)
    return "_".join(parts) or "unknown"


def name_matches(tag: str, gpu: str) -> bool:
    """True when ``tag`` is ``gpu`` or a run of its ``_``-separated words (``"h200"`` matches ``"h200_nvl"``)."""
    return f"_{tag}_" in f"_{gpu}_"


# The sources whose edit makes tuned timings stale: every module of ops/ (the kernels, their launchers, configs and
# plans) and the per-Triton tile overrides, found by listing the folder (file names change; their contents count).
KERNEL_SOURCE_DIRS = ("ops",)
KERNEL_SOURCE_FILES = (os.path.join("compat", "tiles.py"),)


def kernel_sources() -> List[str]:
    """The files :func:`kernel_source_hash` reads, relative to the package folder, in a fixed order."""
    package = os.path.dirname(os.path.abspath(__file__))
    names = []
    for folder in KERNEL_SOURCE_DIRS:
        try:
            names += sorted(os.path.join(folder, n) for n in os.listdir(os.path.join(package, folder))
                            if n.endswith(".py"))
        except OSError:
            pass
    return names + [f for f in KERNEL_SOURCE_FILES if os.path.isfile(os.path.join(package, f))]


@functools.lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    """First 10 hex digits of the SHA-256 of the kernel sources (:func:`kernel_sources`): a kernel edit invalidates
    cached timings even when the library version is unchanged (as during development)."""
    h = hashlib.sha256()
    package = os.path.dirname(os.path.abspath(__file__))
    for name in kernel_sources():
        h.update(name.replace(os.sep, "/").encode())
        try:
            with open(os.path.join(package, name), "rb") as f:
                h.update(f.read())
        except OSError:
            pass
    return h.hexdigest()[:10]


def _library_version() -> str:
    return f"{__version__}+{kernel_source_hash()}"


@dataclass(frozen=True)
class DeviceKey:
    """What a tuned config was measured on. ``key`` is its string form in the JSON cache.

    ``library`` is the package version plus a hash of the kernel sources (``0.1.0+1a2b3c4d5e``).
    """

    gpu: str  # normalized name
    capability: str  # "sm90", "none" without CUDA
    triton: str
    library: str = field(default_factory=_library_version)

    @property
    def key(self) -> str:
        return f"{self.gpu}|{self.capability}|triton-{self.triton}|powersgd_triton-{self.library}"

    def as_dict(self) -> dict:
        return {"gpu": self.gpu, "capability": self.capability, "triton": self.triton, "library": self.library}

    def __str__(self) -> str:
        return self.key


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # pragma: no cover - triton missing
        return "none"


def device_key(device: Optional[torch.device] = None, gpu_name: Optional[str] = None) -> DeviceKey:
    """The key of ``device`` (default: the current CUDA device).

    The GPU name is ``gpu_name``, else ``$POWERSGD_TRITON_GPU_NAME``, else ``torch.cuda.get_device_name(device)``,
    else ``"cpu"`` without CUDA. The capability is ``"none"`` without CUDA.
    """
    name = gpu_name or os.environ.get("POWERSGD_TRITON_GPU_NAME") or None
    capability = "none"
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if cuda:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(dev)
        capability = f"sm{major}{minor}"
        if name is None:
            name = torch.cuda.get_device_name(dev)
    return DeviceKey(normalize_gpu_name(name or "cpu"), capability, _triton_version())


_DEVICE_KEYS: Dict[str, DeviceKey] = {}


def device_key_of(device) -> DeviceKey:
    """:func:`device_key` of ``device``, remembered for the process (a CUDA device without an index: the current
    one). What the first-use verdicts are filed under; a :class:`~powersgd_triton.autotune.Tuner` without a fixed
    device computes the same key."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    k = str(dev)
    if k not in _DEVICE_KEYS:
        _DEVICE_KEYS[k] = device_key(dev)
    return _DEVICE_KEYS[k]
