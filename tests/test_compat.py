"""powersgd_triton.compat.versions: the tested minimum versions (pyproject's floors) and the version-dependent APIs' gates.

A triton older than the floor is not used (backend "auto" falls back to the torch backend, "triton" raises naming the
version); an ASTSource without ``constexprs=`` is refused by name; FSDP2 without ``set_all_reduce_hook`` is named;
and no module outside ``compat/versions.py`` reaches those APIs directly.
"""

import os
import re
from pathlib import Path

import pytest
import torch

from powersgd_triton.compat import versions as _compat
from powersgd_triton.compat import env as _env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, expected", [("2.13.0+cpu", (2, 13, 0)), ("3.7.0.dev20250101", (3, 7, 0)),
                                            ("3.6", (3, 6)), ("v2.11.1rc1", (2, 11, 1))])
def test_version_tuple(text, expected):
    assert _compat.version_tuple(text) == expected


def test_version_tuple_refuses_text_without_a_number():
    with pytest.raises(ValueError, match="not a version"):
        _compat.version_tuple("nightly")


def test_pyproject_floors_are_the_tested_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    torch_floor = re.search(r'"torch>=([\d.]+)"', text).group(1)
    triton_floor = re.search(r'"triton>=([\d.]+)[;"]', text).group(1)
    assert _compat.version_tuple(torch_floor) == _compat.MIN_TORCH
    assert _compat.version_tuple(triton_floor) == _compat.MIN_TRITON
    assert min(_compat.version_tuple(v) for v in _compat.TESTED["torch"])[:2] == _compat.MIN_TORCH
    assert min(_compat.version_tuple(v) for v in _compat.TESTED["triton"])[:2] == _compat.MIN_TRITON


@pytest.fixture
def old_triton(monkeypatch):
    """triton reporting 3.1.0 (older than the floor), with the cached availability probe reset around the test."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.1.0")
    _env.triton_available.cache_clear()
    yield
    monkeypatch.undo()
    _env.triton_available.cache_clear()


def test_triton_older_than_the_floor_is_not_used(old_triton):
    reason = _compat.triton_too_old()
    assert reason and "triton 3.1.0 is older than 3.4" in reason
    assert not _env.triton_available()
    assert "triton 3.1.0 is older than 3.4" in _env.triton_unavailable_reason(torch.device("cpu"))
    assert any("triton 3.1.0" in n for n in _compat.untested_versions())
    from powersgd_triton import PowerSGDState

    with pytest.raises(RuntimeError, match="triton 3.1.0 is older than 3.4"):
        PowerSGDState(process_group=None, matrix_approximation_rank=2, backend="triton")
    from powersgd_triton.ops import resolve_backend

    assert resolve_backend("auto", torch.zeros(4)) == "torch"


def test_this_install_is_not_below_the_floors():
    assert _compat.triton_too_old() is None
    assert _compat.untested_versions() == ()


def test_ast_source_refuses_the_old_signature_by_name(monkeypatch):
    pytest.importorskip("triton")
    import triton.compiler

    class OldASTSource:  # triton 3.0/3.1: constants= keyed by index
        def __init__(self, fn, signature, constants=None, attrs=None):
            raise AssertionError("must not be called")

    monkeypatch.setattr(triton.compiler, "ASTSource", OldASTSource)
    with pytest.raises(RuntimeError, match="ASTSource has no constexprs=.*fn, signature, constants, attrs"):
        _compat.ast_source(lambda: None, {"x": "i32"}, {})


def test_jit_specialization_is_the_jits():
    """What Triton's JIT makes of a launch's arguments on a GPU (the compile table compiles it in): a 16-byte aligned
    tensor and an integer divisible by 16 are marked ``tt.divisibility = 16``, an unaligned tensor and another
    integer are not, the integer 1 becomes a constant, a float is not specialized. The compat tier runs this under
    triton 3.4 (Python specializer), 3.6 and 3.8 (C++)."""
    pytest.importorskip("triton")
    base = torch.zeros(16)
    assert _compat.jit_specialization(base) == ("*fp32", "D", [["tt.divisibility", 16]])
    assert _compat.jit_specialization(base[1:]) == ("*fp32", "", [])  # 4 bytes past an aligned start
    assert _compat.jit_specialization(base[4:])[1] == "D"  # 16 bytes past it
    assert _compat.jit_specialization(torch.zeros(8, dtype=torch.bfloat16)[8:])[0] == "*bf16"
    assert _compat.jit_specialization(48) == ("i32", "D", [["tt.divisibility", 16]])
    assert _compat.jit_specialization(0)[1] == "D"
    assert _compat.jit_specialization(17) == ("i32", "", [])
    assert _compat.jit_specialization(1)[:2] == ("constexpr", 1)
    assert _compat.jit_specialization(2**40)[:2] == ("i64", "D")
    assert _compat.jit_specialization(0.5)[1] is None


def test_gpu_target_fields():
    pytest.importorskip("triton")
    t = _compat.gpu_target(90)
    assert (t.backend, t.arch, t.warp_size) == ("cuda", 90, 32)


def test_fsdp_hook_gate(monkeypatch):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    assert _compat.fsdp_all_reduce_hook_missing() is None  # torch 2.13 has it
    monkeypatch.delattr(fsdp.FSDPModule, "set_all_reduce_hook")
    missing = _compat.fsdp_all_reduce_hook_missing()
    assert "no set_all_reduce_hook" in missing and "torch 2.7" in missing
    from powersgd_triton.fsdp.hsdp import _fsdp_api

    with pytest.raises(RuntimeError, match="no set_all_reduce_hook"):
        _fsdp_api()


def test_fsdp_gates_read_either_torchs_internals():
    """The FSDP2 internals that differ between torch 2.8-2.11 and later releases, on stand-ins of both layouts."""
    from types import SimpleNamespace as NS

    a, b = object(), object()
    assert _compat.fsdp_param_groups(NS(_fsdp_param_groups=[a, b])) == [a, b]  # after torch 2.11
    assert _compat.fsdp_param_groups(NS(_fsdp_param_group=a)) == [a]  # torch 2.8-2.11
    assert _compat.fsdp_param_groups(NS(_fsdp_param_group=None)) == []  # a module without parameters
    assert _compat.fsdp_param_groups(NS(_fsdp_param_groups=[], _fsdp_param_group=a)) == []  # the list wins
    assert not _compat.fsdp_divide_factor_set(NS(gradient_divide_factor=None))
    assert _compat.fsdp_divide_factor_set(NS(gradient_divide_factor=3.0))  # torch >= 2.8
    assert _compat.fsdp_divide_factor_set(NS(reduce_scatter_reduce_op="premul_sum"))  # torch 2.7
    assert not _compat.fsdp_divide_factor_set(NS())
    assert _compat.fsdp_unused_params_option(NS(set_reduce_scatter_unused_params=lambda flag: None))
    assert not _compat.fsdp_unused_params_option(NS(set_reduce_scatter_unused_params=None))
    assert not _compat.fsdp_unused_params_option(NS())


def test_replicate_gates():
    """FSDP2-based replicate(): absent (torch 2.8) -> a message naming the version and the DDP-based way; present ->
    None. A parameter group whose mesh_info is not exactly a DDPMeshInfo, or lacks the group, is unknown."""
    from types import SimpleNamespace as NS

    missing = _compat.replicate_with_fsdp_missing()
    has = _compat.torch_version()[:2] > (2, 8)
    assert (missing is None) == has, missing
    if missing:
        assert torch.__version__ in missing and "register_comm_hook" in missing
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    assert "not a DDPMeshInfo" in _compat.fsdp_replicate_group_unknown(NS(mesh_info=NS(replicate_process_group=1)))
    info = DDPMeshInfo.__new__(DDPMeshInfo)  # no mesh needed: only the type and the attribute are read
    info.replicate_process_group = None
    assert "missing" in _compat.fsdp_replicate_group_unknown(NS(mesh_info=info))
    group = object()
    info.replicate_process_group = group
    assert _compat.fsdp_replicate_group_unknown(NS(mesh_info=info, _all_reduce_process_group=group)) is None
    assert "is not mesh_info" in _compat.fsdp_replicate_group_unknown(
        NS(mesh_info=info, _all_reduce_process_group=object()))


def test_version_dependent_apis_are_reached_through_compat_only():
    """``ASTSource``/``GPUTarget`` are built in ``compat/versions.py`` alone; FSDP2's hook and its version-dependent internals
    (parameter groups, divide factor, unused-parameter option) are probed there alone."""
    offenders = []
    for path in (ROOT / "powersgd_triton").rglob("*.py"):
        if path.relative_to(ROOT).as_posix() == "powersgd_triton/compat/versions.py":
            continue
        text = path.read_text()
        for pattern in (r"\bASTSource\(", r"\bGPUTarget\(", r"import ASTSource", r"import GPUTarget",
                        r"hasattr\([^)]*set_all_reduce_hook", r"_fsdp_param_groups?\b", r"\bgradient_divide_factor\b",
                        r"(has|get)attr\([^)]*set_reduce_scatter_unused_params"):
            if re.search(pattern, text):
                offenders.append(f"{os.path.relpath(path, ROOT)}: {pattern}")
    assert not offenders, offenders


# ---------------------------------------------------------------------- the tests' own poisoned allocations (conftest)
def test_allocations_in_tests_are_poisoned():
    from powersgd_triton import benchmarking as B

    x = torch.ones(3)
    for t in (torch.empty(4), torch.empty_like(x), x.new_empty(5), torch.empty_strided((2, 2), (2, 1)),
              torch.empty(3, dtype=torch.bfloat16)):
        assert torch.isnan(t).all(), t
    assert (torch.empty(3, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()
    assert (torch.empty(2, dtype=torch.uint8) == 255).all()
    assert torch.empty(2, device="meta").is_meta
    with B.OpCounter() as ops:  # the poisoning is invisible to dispatch modes (op counts stay what the code does)
        torch.empty(3)
    assert ops.compute == 0 and ops.by_kind["alloc"] == 1
    leaf = torch.empty(2, requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf


@pytest.mark.no_poison
def test_no_poison_marker_turns_it_off():
    assert torch.empty.__name__ == "empty" and torch.Tensor.new_empty.__name__ == "new_empty"  # torch's own


def _harness_rank(rank, world_size):
    return {"nan": bool(torch.empty(3).isnan().all()), "env": os.environ.get("POWERSGD_HARNESS_PROBE"),
            "threads": torch.get_num_threads(), "world": torch.distributed.get_world_size()}


@pytest.mark.parametrize("poisoned", [True, pytest.param(False, marks=pytest.mark.no_poison)])
def test_harness_ranks_take_the_tests_environment_and_poisoning(tmp_path, monkeypatch, poisoned):
    """``_dist.run_ranks`` starts its ranks from a fork server: they must still see what the launching test set up."""
    from _dist import run_ranks

    probe = os.urandom(4).hex()
    monkeypatch.setenv("POWERSGD_HARNESS_PROBE", probe)
    for r in run_ranks(_harness_rank, 2, tmp_path):
        assert r == {"nan": poisoned, "env": probe, "threads": 1, "world": 2}


def test_dot_min_k_follows_the_installed_triton():
    """tl.dot's smallest inner dimension from this Triton's NVIDIA backend: the float64 products of the
    orthogonalization kernel use tl.dot only from there (triton 3.6 refused K = 4 for float64 on the GPU image)."""
    pytest.importorskip("triton")
    import triton

    from powersgd_triton.ops import orthogonalization as O

    k64, k32 = _compat.dot_min_k(64), _compat.dot_min_k(32)
    version = _compat.version_tuple(triton.__version__)[:2]
    if version >= (3, 9):
        assert (k64, k32) == (4, 8)
    elif version == (3, 6):
        assert (k64, k32) == (16, 16)
    if version <= (3, 4):  # no float64 tl.dot at all: the kernel broadcasts every float64 product
        assert not _compat.dot_float64_supported() and k64 == _compat.NO_DOT_K
    elif version >= (3, 6):
        assert _compat.dot_float64_supported() and k64 <= 16
    assert bool(O._DOT64) == _compat.dot_float64_supported()
    assert int(O._DOT64_K) == k64 and int(O._DOT64_K8) == max(8, k64)


def test_older_triton_tiles_are_keyed_by_version(monkeypatch):
    """A tile that spills under an older Triton is swapped for that Triton only (triton 3.6: reconstruct at R 8)."""
    from powersgd_triton.compat import tiles as CT
    from powersgd_triton.ops import configs as L

    older = CT.OLDER_TRITON_TILES[(3, 6)][("reconstruct", 8, 4)]
    assert older != L.RECONSTRUCT_TILES[(8, 4)]
    for version, expected in (((3, 4), older), ((3, 6), older), ((3, 8), L.RECONSTRUCT_TILES[(8, 4)]),
                              ((3, 9), L.RECONSTRUCT_TILES[(8, 4)]), (None, L.RECONSTRUCT_TILES[(8, 4)])):
        monkeypatch.setattr(CT, "_triton_minor", lambda version=version: version)
        assert L.broadcast_tile("reconstruct", L.RECONSTRUCT_TILES, 8, 4) == expected, version
        assert L.broadcast_tile("project", L.PROJECT_TILES, 8, 4) == L.PROJECT_TILES[(8, 4)]
        # triton 3.4's own entry wins over 3.6's; 3.6 and newer keep the table's R 2 fp32 project_t tile
        t34, table = CT.OLDER_TRITON_TILES[(3, 4)][("project_t", 2, 4)], L.PROJECT_T_TILES[(2, 4)]
        assert L.broadcast_tile("project_t", L.PROJECT_T_TILES, 2, 4) == (t34 if version == (3, 4) else table), version
        p1 = CT.OLDER_TRITON_TILES[(3, 6)][("project_t", 1, 4)]
        assert L.broadcast_tile("project_t", L.PROJECT_T_TILES, 1, 4) == (
            p1 if version in ((3, 4), (3, 6)) else L.PROJECT_T_TILES[(1, 4)]), version
        # project's aligned 2-byte R 1 tile: capped at 96 registers under 3.6 (its PACK variant spilled at ptxas' 40)
        a1 = CT.OLDER_TRITON_TILES[(3, 6)][("project_aligned", 1, 2)]
        assert a1[3] == 96 and a1[:3] == L.ALIGNED_PROJECT_TILES[(1, 2)][:3]
        assert L.broadcast_tile("project_aligned", L.ALIGNED_PROJECT_TILES, 1, 2) == (
            a1 if version in ((3, 4), (3, 6)) else L.ALIGNED_PROJECT_TILES[(1, 2)]), version
        # project's tl.dot tile at R 16 on 2-byte gradients: 32 columns per step up to 3.8 (its PACK variants
        # spilled 8 bytes under 3.8), 64 on 3.9; 4-byte gradients keep 64 everywhere
        dot = dict(BLOCK_N=16, BLOCK_K=64, USE_DOT=True, num_warps=4, num_stages=3)
        older = version is not None and version <= (3, 8)
        assert L.dot_config("project", 16, 2, dot) == dict(dot, BLOCK_K=32 if older else 64), version
        assert L.dot_config("project", 16, 4, dot) == dot, version
