"""The autotuner's cache keys (shape classes, device keys): they live in :mod:`powersgd_triton.keys`, where the
first-use verdicts (:mod:`powersgd_triton.ops.verify`) also read them; re-exported here for the tuner's users."""

from powersgd_triton.keys import (  # noqa: F401
    DTYPE_NAMES,
    DTYPES_BY_NAME,
    STREAMING_KERNELS,
    DeviceKey,
    ShapeClass,
    device_key,
    device_key_of,
    dtype_name,
    kernel_source_hash,
    kernel_sources,
    name_matches,
    normalize_gpu_name,
    parse_dtype,
    shape_class,
    size_class,
)
