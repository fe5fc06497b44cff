"""powersgd_triton.variants: the one table of our hooks agrees with the hook modules, and no other room names them."""

import pathlib
import subprocess
import sys

import pytest

import powersgd_triton
from powersgd_triton import variants

PACKAGE = pathlib.Path(powersgd_triton.__file__).parent


@pytest.mark.parametrize("variant", variants.VARIANTS, ids=lambda v: v.name)
def test_row_matches_its_hook_module(variant):
    import importlib

    hook = variant.load()
    assert hook is getattr(powersgd_triton, variant.hook_name)  # the public name is the same object
    assert variant.function == f"powersgd_triton.{variant.hook_name}"
    step = getattr(importlib.import_module(variant.module), variant.step)
    assert step.name == variant.hook_name and step.batched == variant.batched
    assert variants.of_function(hook) is variant
    assert variants.get(variant.name) is variant


@pytest.mark.parametrize("variant", variants.VARIANTS, ids=lambda v: v.name)
def test_warm_start_only_is_what_the_step_class_checks(variant):
    cold = powersgd_triton.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1,
                                         use_error_feedback=False, warm_start=False)
    if variant.warm_start_only:
        with pytest.raises(ValueError, match="warm_start"):
            variant.check_settings(cold)
    else:
        variant.check_settings(cold)  # accepted
    variant.check_settings(powersgd_triton.PowerSGDState(process_group=None, matrix_approximation_rank=1))


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="expected one of .*'powersgd'"):
        variants.get("nope")
    assert variants.of_function(print) is None


def test_the_commands_read_the_table():
    from powersgd_triton.benchmarking import ALL_IMPLS
    from powersgd_triton.fsdp.checks import HOOKS as FSDP
    from powersgd_triton.train.config import FSDP_HOOKS, HOOKS

    assert HOOKS[: len(variants.NAMES)] == variants.NAMES
    assert set(FSDP_HOOKS) - {"allreduce"} == {v.name for v in variants.VARIANTS if v.fsdp}
    assert set(FSDP) == {v.hook_name for v in variants.VARIANTS if v.fsdp}
    assert {v.name for v in variants.VARIANTS if v.pytorch_twin is None} <= set(ALL_IMPLS)


def test_the_table_imports_no_torch():
    code = "import sys, powersgd_triton.variants, powersgd_triton.train.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _files_naming(word: str):
    word = word.lower()
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*")
                  if p.is_file() and p.suffix in (".py", ".md", ".json", ".txt", ".toml")
                  and word in p.read_text(encoding="utf-8", errors="replace").lower())


@pytest.mark.parametrize("variant", [v for v in variants.VARIANTS if v.pytorch_twin is None], ids=lambda v: v.name)
def test_a_variant_is_named_in_at_most_six_package_files(variant):
    """Adding a variant is its step class, its public name and its row in the table (the re-seat's acceptance):
    the train/bench/analysis commands, FSDP, the integrations, the state and the kernels never name it."""
    files = set(_files_naming(variant.name)) | set(_files_naming(variant.hook_name))
    assert len(files) <= 6, sorted(files)
    assert not [f for f in files if f.startswith(("state/", "ops/", "fsdp/", "train/", "benchmarking/"))]
