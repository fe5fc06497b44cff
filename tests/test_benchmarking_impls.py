"""benchmarking.make_hook / compare_hooks with the alternating hook (what notebooks/03 times)."""

import pytest

from powersgd_triton import benchmarking as B


def test_make_hook_knows_the_alternating_hook():
    import powersgd_triton as pkg

    state, hook = B.make_hook("alternating", 2, backend="torch")
    assert hook is pkg.alternating_powerSGD_hook and isinstance(state, pkg.PowerSGDState)
    assert state.matrix_approximation_rank == 2 and state.start_powerSGD_iter == 2 and state.backend == "torch"
    with pytest.raises(RuntimeError):
        B.make_hook("alternating", 2, batched=True)
    with pytest.raises(ValueError):
        B.make_hook("nope", 2)
    assert B.IMPLS == ("pytorch", "ours") and "alternating" in B.ALL_IMPLS


def test_compare_hooks_with_three_impls(world1):
    rows = B.compare_hooks("resnet50", 2, "fp32", "cpu", backend="torch", rounds=1, shrink=16,
                           bucket_cap_mb=25.0 / 256, first_bucket_mb=1.0 / 256, impls=("ours", "alternating"))
    assert [r["impl"] for r in rows] == ["pytorch", "ours", "alternating"]
    assert "speedup" not in rows[0] and rows[1]["speedup"] > 0 and rows[2]["speedup"] > 0
    pt, ours, alt = rows
    assert pt["allreduce_calls"] == ours["allreduce_calls"] == 3 * pt["buckets"]
    assert pt["allreduce_bytes"] == ours["allreduce_bytes"]
    assert alt["allreduce_calls"] == alt["buckets"]  # one all-reduce per bucket
    assert alt["allreduce_bytes"] < ours["allreduce_bytes"]
    # default: the two implementations bench/ has always compared
    default = B.compare_hooks("resnet50", 2, "fp32", "cpu", backend="torch", rounds=1, counts=False, shrink=16,
                              bucket_cap_mb=25.0 / 256, first_bucket_mb=1.0 / 256)
    assert [r["impl"] for r in default] == ["pytorch", "ours"]
