#!/usr/bin/env bash
# The first GPU run of powersgd_triton as ONE prepared command (issue 39 item 4).
#
#   PYTHONPATH=. bench/gpu_first_run.sh              # on the GPU image, from the checkout: within 9 minutes
#   PYTHONPATH=. bench/gpu_first_run.sh --dry-run    # rehearsal on CPU (interpreter, gloo, tiny shapes): < 4 minutes
#
# The GPU image: Python 3.12, torch 2.11, triton 3.6, numpy; no platformdirs, no package index: this installs
# nothing. A lent GPU has 15 minutes in all (docs/development.md), so the whole run is budgeted to 510 s
# (GPU_FIRST_RUN_BUDGET) to fit one call of 9-10 minutes and leave room for a rerun. Steps, in order, each under
# `timeout` and written under $OUT as it finishes (the device tool copies $OUT back even from a run cut short):
#   1. preflight          bench/first_run_preflight.py: versions, GPU, SMs, NCCL, C compiler and Python.h for
#                         Triton's launcher, one trivial Triton launch            -> $OUT/preflight/preflight.json
#   2. gpu_check --quick  bench/gpu_check.py --quick (stops itself at 245 s)      -> $OUT/gpu_check/gpu_check.{json,md}
#   3. train              a 1-rank NCCL DDP run of charlm (no download: CPython's pydoc text) with our
#                         powerSGD_hook on the Triton kernels, verify="first", warm start (the next Q orthogonalized
#                         on the side stream), 30 compressed steps                 -> $OUT/train/train.json
#   4. timing             bench/gpu_check.py's kernel and hook timing sections (do_bench) in the time left
#                                                                                  -> $OUT/timing/gpu_check.{json,md}
#   5. autotune           powersgd-triton autotune --export: the tuner's configs for ResNet-50 at rank 4, fp32 and
#                         bf16, in the rest of the time                            -> $OUT/autotune/
# $OUT/first_run.md (and first_run.jsonl) list every step's exit status, seconds and outputs after each step.
# Exit status: 0 when every step exited 0, else 1. What each output decides: docs/guides/gpu-check.md.
# A rerun of some steps only (a step that failed, in the minutes a lease has left): --steps train,timing, with
# GPU_FIRST_RUN_BUDGET=SECONDS for what is left (the later steps share the rest of it).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
PY=${PYTHON:-$(command -v python3 || command -v python)}

DRY=0
STEPS=preflight,gpu_check,train,timing,autotune
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --steps) STEPS=${2:?--steps needs a comma list}; shift ;;
        --steps=*) STEPS=${1#--steps=} ;;
        -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;
        *) echo "gpu_first_run.sh: unknown argument $1 (--dry-run, --steps a,b)" >&2; exit 2 ;;
    esac
    shift
done
for s in ${STEPS//,/ }; do
    case "$s" in preflight|gpu_check|train|timing|autotune) ;;
        *) echo "gpu_first_run.sh: unknown step $s (preflight, gpu_check, train, timing, autotune)" >&2; exit 2 ;;
    esac
done

if [ "$DRY" = 1 ]; then
    BUDGET=${GPU_FIRST_RUN_BUDGET:-220}
    OUT=${OUT:-$(mktemp -d /tmp/gpu_first_run.XXXXXX)}
    # the GPU image has none of these: the rehearsal hides them (a module that raises ImportError on import)
    HIDE=$(mktemp -d /tmp/gpu_first_run_hide.XXXXXX)
    for mod in platformdirs tqdm sklearn mlxtend; do
        echo "raise ImportError('$mod: hidden by gpu_first_run.sh --dry-run (the GPU image has none)')" > "$HIDE/$mod.py"
    done
    export PYTHONPATH="$HIDE:$PYTHONPATH"
else
    BUDGET=${GPU_FIRST_RUN_BUDGET:-510}
    OUT=${OUT:-$ROOT/gpu_first_run_out}
fi
export OUT
mkdir -p "$OUT"/preflight "$OUT"/gpu_check "$OUT"/train "$OUT"/timing "$OUT"/autotune
# the autotuner's and the first-use check's caches in $OUT: they come back with the results
export POWERSGD_TRITON_CONFIG_DIR="$OUT/autotune/cache" POWERSGD_TRITON_CACHE_DIR="$OUT/cache"
SUMMARY="$OUT/first_run.md"
T0=$SECONDS
FAILED=0
left() { echo $((BUDGET - (SECONDS - T0))); }

{
    echo "# gpu_first_run.sh $([ "$DRY" = 1 ] && echo "--dry-run ")($(date -u +%FT%TZ))"
    echo
    echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), budget $BUDGET s, python $PY"
    echo
    echo "| step | exit | seconds | limit s | output |"
    echo "|---|---|---|---|---|"
} > "$SUMMARY"
: > "$OUT/first_run.jsonl"

# step NAME LIMIT OUTPUT CMD...: runs CMD under timeout LIMIT (seconds), its log in $OUT/NAME.log; records it
step() {
    local name=$1 limit=$2 output=$3 t=$SECONDS rc
    shift 3
    case ",$STEPS," in *",$name,"*) ;; *) return ;; esac  # not asked for (--steps)
    if [ "$limit" -lt 5 ]; then
        echo "gpu_first_run: $name skipped: $limit s left" | tee -a "$OUT/$name.log"
        echo "| $name | skipped (no time left) | 0 | $limit | |" >> "$SUMMARY"
        echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": true}" >> "$OUT/first_run.jsonl"
        return
    fi
    echo "gpu_first_run: $name (limit $limit s, $(left) s left of $BUDGET)" >&2
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || FAILED=1
    local note=""
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" (timed out)"
    echo "gpu_first_run: $name exit $rc$note in $((SECONDS - t)) s" >&2
    tail -n 3 "$OUT/$name.log" >&2
    echo "| $name | $rc$note | $((SECONDS - t)) | $limit | $output |" >> "$SUMMARY"
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t)), \"limit\": $limit, \"output\": \"$output\"}" \
        >> "$OUT/first_run.jsonl"
}

min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }

if [ "$DRY" = 1 ]; then
    step preflight "$(min 60 "$(left)")" preflight/preflight.json \
        "$PY" bench/first_run_preflight.py --dry-run --out "$OUT/preflight"
    step gpu_check "$(min 110 "$(left)")" gpu_check/gpu_check.md \
        "$PY" bench/gpu_check.py --dry-run --quick --budget 70 --compile-budget 10 --out "$OUT/gpu_check"
    step train "$(min 90 "$(left)")" train/train.json \
        "$PY" -m powersgd_triton train --workload charlm --hook powersgd --world-size 1 --device cpu \
        --backend gloo --kernels auto --verify first --start-iter 10 --steps 12 --matrix-approximation-rank 4 \
        --out "$OUT/train/train.json" --no-progress
    budget=$(( $(left) - 25 ))
    step timing "$(min 60 "$budget")" timing/gpu_check.md \
        "$PY" bench/gpu_check.py --dry-run --sections env,kernels,hooks --budget "$(( budget > 40 ? 40 : 25 ))" \
        --out "$OUT/timing"
    step autotune "$(min 60 "$(( $(left) - 5 ))")" autotune/ \
        env TRITON_INTERPRET=1 "$PY" -m powersgd_triton autotune --model resnet50 --matrix-approximation-rank 4 \
        --dtype fp32  # nothing is timed in the interpreter: no --export (it would refuse: nothing measured)
else
    step preflight "$(min 60 "$(left)")" preflight/preflight.json \
        "$PY" bench/first_run_preflight.py --out "$OUT/preflight"
    step gpu_check "$(min 265 "$(left)")" gpu_check/gpu_check.md \
        "$PY" bench/gpu_check.py --quick --out "$OUT/gpu_check"
    step train "$(min 120 "$(left)")" train/train.json \
        "$PY" -m powersgd_triton train --workload charlm --hook powersgd --world-size 1 --device cuda \
        --backend nccl --kernels triton --verify first --start-iter 10 --steps 40 --matrix-approximation-rank 4 \
        --out "$OUT/train/train.json" --no-progress
    # the rest: 60 % timing sections (their own budget 30 s under the limit), then the autotuner
    rest=$(( $(left) - 10 ))
    step timing "$(( rest * 6 / 10 ))" timing/gpu_check.md \
        "$PY" bench/gpu_check.py --sections env,copy,kernels,hooks,kernels-extra,hooks-extra \
        --budget "$(( rest * 6 / 10 > 65 ? rest * 6 / 10 - 35 : 30 ))" --out "$OUT/timing"
    step autotune "$(( $(left) - 5 ))" autotune/ \
        "$PY" -m powersgd_triton autotune --model resnet50 --matrix-approximation-rank 4 --dtype fp32 bf16 \
        --warmup-ms 10 --rep-ms 40 --export "$OUT/autotune/"
fi

echo >> "$SUMMARY"
echo "total $((SECONDS - T0)) s of $BUDGET s; $([ "$FAILED" = 0 ] && echo 'every step exited 0' || echo 'a step FAILED')" \
    >> "$SUMMARY"
cat "$SUMMARY"
[ "$DRY" = 1 ] && rm -rf "$HIDE"
exit "$FAILED"
