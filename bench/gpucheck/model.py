"""The performance model's predictions, made by section ``model`` (:mod:`gpucheck.model_phase`) before the timed
sections and outside them (its ahead-of-time compiles: ``ptxas -v``, ``cuobjdump``); the ``kernels`` and ``hooks``
sections only look them up here (:func:`predicted`), so no compile runs inside a timed section."""

from .common import DEVICE, RESULTS

# (what, model, bucket index or None, dtype name, rank, kernel or None) -> predicted ms (None: no prediction)
PREDICTIONS: dict = {}


def prediction_key(what: str, model: str, dtype, rank: int, bucket=None, kernel=None) -> tuple:
    return (what, model, bucket, str(dtype).replace("torch.", ""), int(rank), kernel)


def perf_prediction(what: str, **kw):
    """PERFORMANCE MODEL: its predicted ms for an item, computed now; None without it (section ``model`` only).

    :func:`powersgd_triton.perfmodel.predict_measured` (``what``: "kernel" with kernel, layout, dtype, rank; "hook"
    with model, rank, dtype, buckets; ``device`` always; it compiles the kernels for the GPU, so it runs with
    TRITON_INTERPRET unset and returns None on a GPU other than an H100/H200); any failure gives None and never stops
    the run (the dry run, under the interpreter, gets None).
    """
    try:
        import importlib

        pm = importlib.import_module("powersgd_triton.perfmodel")
        fn = getattr(pm, "predict_measured", None)
        if fn is None:
            return None
        value = fn(what, device=DEVICE, **kw)
        return float(value) if value is not None else None
    except Exception:  # noqa: BLE001 - the model is an extra; the measurement stands alone
        return None


def predicted(key: tuple):
    """The prediction section ``model`` made for ``key`` (:func:`prediction_key`), or None; never compiles. A key it
    did not make is counted in the ``model`` section's ``missed`` (shown as "-")."""
    if key in PREDICTIONS:
        return PREDICTIONS[key]
    sec = RESULTS["sections"].setdefault("model", {})
    sec.setdefault("missed", []).append(" ".join(map(str, key)))
    return None
