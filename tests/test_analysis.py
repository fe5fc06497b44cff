"""powersgd_triton.analysis: the helpers behind notebooks/02 (SVD optimum, compressed layers, real-gradient runs)."""

import math

import pytest
import torch

from _deadline import scaled

from powersgd_triton import analysis
from powersgd_triton.layout import BucketLayout


def test_svd_optimum_exact_low_rank_and_random(rng):
    a = torch.randn(40, 3, generator=rng, dtype=torch.float64)
    b = torch.randn(3, 25, generator=rng, dtype=torch.float64)
    m = a @ b
    assert analysis.svd_optimum(m, 3) < 1e-12
    assert analysis.svd_optimum(m, 1) > 0.01
    x = torch.randn(30, 20, generator=rng)
    s = torch.linalg.svdvals(x.double())
    u, sv, vh = torch.linalg.svd(x.double(), full_matrices=False)
    best = (u[:, :2] * sv[:2]) @ vh[:2]
    assert analysis.svd_optimum(x, 2) == pytest.approx(analysis.relative_error(x, best), rel=1e-9)
    assert analysis.svd_optimum(x, 2) == pytest.approx(math.sqrt(float((s[2:] ** 2).sum() / (s**2).sum())))
    # conv-shaped gradients are viewed as (shape[0], -1), like the hook does
    w = torch.randn(8, 4, 3, 3, generator=rng)
    assert analysis.svd_optimum(w, 2) == pytest.approx(analysis.svd_optimum(w.reshape(8, 36), 2))
    assert math.isnan(analysis.svd_optimum(torch.zeros(5, 4), 1))
    assert math.isnan(analysis.relative_error(torch.zeros(3), torch.ones(3)))


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_compressed_layers_match_the_layout(rank):
    shapes = {"a": (10, 128), "b": (128, 1024), "c": (64, 32, 3, 3), "d": (32, 1, 3, 3), "bias": (128,)}
    buf = torch.zeros(sum(math.prod(s) for s in shapes.values()))
    grads, off = [], 0
    for s in shapes.values():
        grads.append(buf[off : off + math.prod(s)].view(s))
        off += math.prod(s)
    layout = BucketLayout.from_gradients(buf, grads, rank, 2.0)
    names = list(shapes)
    expected = sorted(names[spec.grad_index] for spec in layout.matrices)
    assert sorted(analysis.compressed_layers(shapes, rank)) == expected


def test_config_validation():
    with pytest.raises(ValueError):
        analysis.approximation_errors(workload="imagenet")
    with pytest.raises(ValueError):
        analysis.approximation_errors(mode="sometimes")
    with pytest.raises(ValueError):
        analysis.approximation_errors(impls=("nope",))
    with pytest.raises(ValueError):
        analysis.approximation_errors(ranks=(0,))


@pytest.mark.parametrize("mode, kernels", [("fixed", "auto"), ("trajectory", "torch")])
def test_real_gradients_two_ranks(mode, kernels):
    """Two gloo ranks on the digits convnet: ours (the Triton kernels in the interpreter, or the torch backend)
    equals PyTorch's hook, nothing beats the SVD optimum, and warm start on a fixed gradient closes in on it."""
    steps = 3
    res = analysis.approximation_errors(workload="digits", mode=mode, ranks=(2,), steps=steps, world_size=2,
                                        kernels=kernels, timeout=scaled(240))
    assert res["kernel_backend"] == ("triton" if kernels == "auto" else "torch")
    recs = res["records"]
    layers = res["compressed_layers"][2]
    assert layers and set(layers) <= set(res["matrix_shapes"])
    assert "classifier.1.weight" in layers and res["matrix_shapes"]["classifier.1.weight"] == [128, 1024]
    for impl in ("ours", "reference", "ours_cold", "svd"):
        assert len(analysis.select(recs, impl=impl)) == steps * len(layers)
    err = {(r["impl"], r["layer"], r["step"]): r["error"] for r in recs}
    for layer in layers:
        for step in range(1, steps + 1):
            ours, ref, svd = (err[i, layer, step] for i in ("ours", "reference", "svd"))
            assert ours == pytest.approx(ref, abs=1e-4)
            assert ours >= svd - 1e-6 and err["ours_cold", layer, step] >= svd - 1e-6
        # the first compressed step starts from the same random Q with and without warm start
        assert err["ours", layer, 1] == pytest.approx(err["ours_cold", layer, 1], abs=1e-6)
    if mode == "fixed":
        big = "classifier.1.weight"
        steps_, errors = analysis.series(recs, impl="ours", rank=2, layer=big)
        assert steps_ == list(range(1, steps + 1))
        assert errors[-1] < errors[0]
        assert errors[-1] <= 1.05 * err["svd", big, steps]
    assert res["compression_rate"]["ours/r2"] == pytest.approx(res["compression_rate"]["reference/r2"])
    assert res["compression_rate"]["ours/r2"] > 10


def test_alternating_takes_two_steps_per_power_iteration_on_a_fixed_gradient():
    """On a fixed gradient without error feedback, the alternating hook's step 2k projects onto the span the standard
    hook's step k projects onto (P_k = M·Q_{k-1} and orth(M·orth(Q_{k-1})) span the same columns), so the errors are
    equal; its step 1 (M·Q'·Q'ᵀ, with M·Q' in the span the standard hook projects onto) can only be worse."""
    steps = 4
    res = analysis.approximation_errors(workload="digits", mode="fixed", ranks=(2,), steps=steps, world_size=2,
                                        impls=("ours", "alternating"), kernels="torch", timeout=scaled(240))
    err = {(r["impl"], r["layer"], r["step"]): r["error"] for r in res["records"]}
    layers = res["compressed_layers"][2]
    assert len(analysis.select(res["records"], impl="alternating")) == steps * len(layers)
    for layer in layers:
        for k in (1, 2):
            assert err["alternating", layer, 2 * k] == pytest.approx(err["ours", layer, k], abs=2e-5), (layer, k)
        assert err["alternating", layer, 1] >= err["ours", layer, 1] - 1e-6
        assert err["alternating", layer, steps] >= err["svd", layer, steps] - 1e-6
    # the compression rate counts what each hook sends: about twice as high for the alternating hook
    assert 1.7 < res["compression_rate"]["alternating/r2"] / res["compression_rate"]["ours/r2"] < 2.3


RESULTS = """# Benchmark results

Intro text with a date 2020-01-01 that belongs to no section.

## CPU, 2026-11-29

Machine: a 2-core VM.

### 1. Hook step

| model | r | PyTorch ms | ours ms |
| --- | --- | --- | --- |
| resnet50 | 4 | 328 | 194 |

## GPU: NVIDIA H200

Machine: one H200 (132 SMs), driver 570.
Measured on 2026-12-01.

| model | r | PyTorch ms | ours ms | PyTorch/ours |
|:---|---:|---|---|---|
| resnet50 | 4 | 30.1 | 4.2 | 7.2x |
| gpt2 | 4 | 80 | 9 | 8.9x |
text after the table

### Kernels
| kernel | GB/s |
| --- | --- |
| project | 3000 |

## H100 runs, 2026-12-02

(no tables yet)

## Notes
| not | a table |
"""


def test_results_sections_and_gpu_tables(tmp_path):
    sections = analysis.results_sections(RESULTS)
    assert [s["heading"] for s in sections] == ["CPU, 2026-11-29", "GPU: NVIDIA H200", "H100 runs, 2026-12-02", "Notes"]
    cpu, gpu, h100, notes = sections
    assert not cpu["gpu"] and gpu["gpu"] and h100["gpu"] and not notes["gpu"]
    assert cpu["date"] == "2026-11-29" and gpu["date"] == "2026-12-01" and notes["date"] is None
    assert cpu["machine"] == "a 2-core VM." and gpu["machine"].startswith("one H200")
    assert cpu["tables"][0]["title"] == "1. Hook step"
    assert cpu["tables"][0]["rows"] == [{"model": "resnet50", "r": "4", "PyTorch ms": "328", "ours ms": "194"}]
    t1, t2 = gpu["tables"]
    assert t1["title"] == "GPU: NVIDIA H200" and t1["columns"][-1] == "PyTorch/ours" and len(t1["rows"]) == 2
    assert t1["rows"][1]["PyTorch/ours"] == "8.9x"
    assert t2["title"] == "Kernels" and t2["rows"] == [{"kernel": "project", "GB/s": "3000"}]
    assert h100["tables"] == [] and notes["tables"] == []  # a single line is no table

    path = tmp_path / "RESULTS.md"
    path.write_text(RESULTS)
    assert [s["heading"] for s in analysis.gpu_results(str(path))] == ["GPU: NVIDIA H200"]
    assert analysis.gpu_results(str(tmp_path / "missing.md")) == []
