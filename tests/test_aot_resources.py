"""tools.aot.resource_usage / blocks_per_sm: registers, spills and occupancy of compiled kernels, without a GPU.

The occupancy arithmetic is checked against cases worked by hand from the sm_80/sm_90 limits; resource_usage on the
``project`` kernel compiled for sm_90 with its heuristic config and with every block size doubled (4x the products a
thread holds in registers on the broadcast path: it must hit the 255-register cap and spill). Compiles run in a
subprocess with ``TRITON_INTERPRET`` unset (this process has interpreted kernels).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _deadline import scaled

from tools.aot import SM_LIMITS, blocks_per_sm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "regs, warps, shared, arch, expected",
    [
        # 255 regs -> 8160 rounded to 8192 per warp; 16384 per sub-partition holds 2 warps; 8 warps per SM: 2 blocks
        (255, 4, 0, 90, dict(blocks_per_sm=2, by_registers=2)),
        # 166 regs -> 5312 -> 5376 per warp: 3 warps per sub-partition, 12 per SM: 3 blocks of 4 warps
        (166, 4, 2048, 80, dict(blocks_per_sm=3, by_registers=3)),
        # 32 regs -> 1024 per warp: 16 per sub-partition, 64 per SM = the warp limit: 16 blocks of 4, 8 of 8
        (32, 4, 0, 90, dict(blocks_per_sm=16, by_registers=16, by_warps=16)),
        (32, 8, 0, 80, dict(blocks_per_sm=8, by_warps=8)),
        # 1 warp of 16 regs: the 32-blocks-per-SM limit binds
        (16, 1, 0, 90, dict(blocks_per_sm=32, by_blocks=32, by_warps=64)),
        # 100 KiB + 1 KiB reserved per block: 1 fits in A100's 164 KiB, 2 in H100's 228 KiB
        (32, 4, 100 * 1024, 80, dict(blocks_per_sm=1, by_shared=1)),
        (32, 4, 100 * 1024, 90, dict(blocks_per_sm=2, by_shared=2)),
        # over the 255-register limit: cannot launch
        (256, 4, 0, 90, dict(blocks_per_sm=0, by_registers=0)),
    ],
)
def test_blocks_per_sm_worked_by_hand(regs, warps, shared, arch, expected):
    got = blocks_per_sm(regs, warps, shared, arch)
    assert {k: got[k] for k in expected} == expected, got
    assert got["blocks_per_sm"] == min(got["by_registers"], got["by_shared"], got["by_warps"], got["by_blocks"])


def test_blocks_per_sm_refuses_unknown_arch():
    with pytest.raises(ValueError, match="sm_75"):
        blocks_per_sm(32, 4, 0, 75)
    assert set(SM_LIMITS) == {80, 90}


SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    import torch
    from powersgd_triton.ops import configs
    from tools import aot_compile
    from tools.aot import _nvidia_tool, resource_usage

    class _Layout:
        max_rank = 4

    light = configs.heuristic_config("project", _Layout(), torch.float32)
    # twice the tile, without the heuristic's register cap (maxnreg: ptxas would spill at it instead)
    heavy = {k: (2 * v if k.startswith("BLOCK") else v) for k, v in light.items() if k != "maxnreg"}
    out = {}
    for name, cfg in (("light", light), ("heavy", heavy)):
        c = aot_compile.compile_aot("project", cfg, torch.float32, 4, 90, None)
        u = resource_usage(c, 90)
        # the registers of the cubin Triton built, as cuobjdump reads them (None when triton ships no cuobjdump)
        tool = _nvidia_tool("cuobjdump", 90)
        u["cubin_registers"] = None
        if tool:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(c.asm["cubin"])
                f.flush()
                dump = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
            u["cubin_registers"] = int(dump.split("REG:")[1].split()[0])
        u["metadata_shared"] = c.metadata.shared
        u["config"] = cfg
        out[name] = u
    json.dump(out, sys.stdout)
    """
)


@pytest.mark.timeout(300)
def test_resource_usage_heuristic_vs_register_heavy_config(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "usage.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=REPO, TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=scaled(280))
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    light, heavy = res["light"], res["heavy"]
    for u in (light, heavy):
        if u["cubin_registers"] is not None:  # ptxas -v re-run agrees with the binary Triton built
            assert u["registers"] == u["cubin_registers"], u
        assert u["shared_bytes"] >= u["metadata_shared"]
        assert (u["num_warps"], u["num_stages"]) == (u["config"]["num_warps"], u["config"]["num_stages"])
        assert u["blocks_per_sm"] == blocks_per_sm(u["registers"], u["num_warps"], u["shared_bytes"], 90)[
            "blocks_per_sm"]
    # 4x the [BLOCK_N, BLOCK_K, R] accumulator per thread: more registers (or spills at the cap), fewer blocks per SM
    assert light["registers"] < heavy["registers"] and light["spill_bytes"] == 0, (light, heavy)
    assert heavy["registers"] == 255 or heavy["spill_bytes"] == 0, heavy  # spills only once at the register cap
    assert heavy["blocks_per_sm"] < light["blocks_per_sm"]


def _sass(*instructions):
    """cuobjdump -sass lines for ``instructions`` at addresses 0x0100, 0x0110, ... (a backward BRA closes a loop)."""
    return "\n".join(f"        /*{0x100 + 16 * i:04x}*/                   {text} ;     /* 0x000000000000 */"
                     for i, text in enumerate(instructions))


@pytest.mark.parametrize("name, body, loads, trip", [
    # a register prefetch rotated by a copy: the copy waits for the load issued at the top of the same trip
    ("rotated", ["LDG.E R4, desc[UR4][R2.64]", "FFMA R10, R6, R7, R10", "IMAD.MOV.U32 R6, RZ, RZ, R4"], 1, 1.0),
    # the next step's load sunk below the arithmetic that uses the last one, into the same register
    ("sunk", ["FFMA R10, R4, R7, R10", "@P1 LDG.E R4, desc[UR4][R2.64+0x10]"], 1, 1.0),
    # unrolled twice with two register sets: b's load is in flight while a is used, a's next while b is
    ("two sets", ["LDG.E R4, desc[UR4][R2.64]", "FFMA R10, R6, R7, R10", "LDG.E R6, desc[UR4][R2.64+0x10]",
                  "FFMA R10, R4, R7, R10"], 2, 1.0),
    # loads interleaved with the waits: two latencies per trip
    ("serial", ["LDG.E R4, desc[UR4][R2.64]", "FADD R10, R4, R10", "LDG.E R5, desc[UR4][R2.64+0x4]",
                "FADD R10, R5, R10"], 2, 2.0),
    # a 128-bit load writes 4 registers: a reader of its last one waits; a store reads its data register
    ("wide", ["LDG.E.128 R4, desc[UR4][R2.64]", "STG.E desc[UR4][R8.64], R7"], 1, 1.0),
    # an overwrite of a register whose load is pending waits too (the masked load's zero fill before the load)
    ("overwrite", ["@P0 LDG.E.U16 R4, desc[UR4][R2.64]", "PRMT R4, RZ, 0x7610, R4"], 1, 1.0),
])
def test_sass_loop_replay(name, body, loads, trip):
    """aot.sass_loops on hand-written loops: the DRAM latencies one trip waits in steady state."""
    from tools.aot import sass_loops

    text = _sass("MOV R10, RZ", *body, "@P0 BRA 0x110", "EXIT", "BRA 0x" + f"{0x100 + 16 * (len(body) + 3):04x}")
    loops = sass_loops(text)
    assert [(lp["start"], lp["instructions"]) for lp in loops] == [(0x110, len(body) + 1), (0x100 + 16 * (len(body) + 3), 1)]
    assert loops[0]["global_loads"] == loads and loops[0]["trip_latencies"] == pytest.approx(trip), loops[0]
    assert loops[1]["global_loads"] == 0 and loops[1]["trip_latencies"] == 0  # the end-of-kernel self-branch


def test_sass_loop_counts_barriers_shuffles_shared_and_local():
    from tools.aot import sass_loops

    text = _sass("LDG.E R4, desc[UR4][R2.64]", "STS [R9], R4", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDS R5, [R9+0x4]",
                 "SHFL.BFLY PT, R6, R5, 0x1, 0x1f", "STL [R1], R6", "LDL R7, [R1]", "FADD R10, R7, R10",
                 "@P0 BRA 0x100")
    (loop,) = sass_loops(text)
    assert (loop["barriers"], loop["shuffles"], loop["shared"], loop["local"], loop["global_loads"]) == (1, 1, 2, 2, 1)
    assert loop["trip_latencies"] == 1.0  # the shared store of the loaded register waits for it
