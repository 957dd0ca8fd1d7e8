#!/usr/bin/env bash
# Block-wise rounding (blockround) at real size on one H200: the kernels' checks, then the main
# job's own path (benchmarks/bench_ptq.py -> tools/run_ptq.py) on layer 2 of a 3-layer synthetic
# V4-Flash checkpoint (ratio 4, hash routing, compressor + indexer) at 128 x 2048 calibration.
#
#   bash benchmarks/scripts/h200_block_rounding.sh [STAGE ...]     (default: env kernels ckpt)
#
# Stages:
#   env                 GPU, torch, triton versions
#   kernels             benchmarks/check_block_rounding_kernels.py (fused fake-quant, grouped GEMM)
#   hc                  benchmarks/check_hc_autograd.py --check (the hc ends under autograd: time,
#                       memory, accuracy against fp64, torch's path against the fused Functions)
#   attn                benchmarks/check_banded_attention.py --check (the sparse attention under
#                       autograd: time, memory, accuracy against fp64, plain ops against BandedAttention)
#   ckpt | ckpt-pro     the synthetic checkpoint (V4-Flash 3 layers | V4-Pro 3 layers)
#   rm-flash            delete the V4-Flash checkpoint (disk: 64 GiB hold Flash or Pro, not both with runs)
#   run@TAG@SCHEME@ALGO[@LIMIT[@MODEL]]   one bench_ptq run of layer 2, ALGO passed as --algo
#                       (with --propagate quant), cut at LIMIT s (default 300); MODEL flash|pro
#   start@TAG@...       the same run in a session of its own (setsid), returning at once: it outlives
#                       the call, so a run longer than one call of the device tool (600 s) ends in the
#                       next call while the machine is held (casebook i34-25)
#   wait@TAG[@SECONDS]  wait (default 560 s) until run TAG has ended; its files come back as any run's
#   AMCT_PROFILE_BLOCKROUND=STEP:PATH in the environment writes a profile of that step.
#   BR_PROFILE_STEP=N profiles step N of every run (prof_TAG.txt); BR_BENCH_ARGS goes to bench_ptq
#   (e.g. "--max-device-gib 60 --max-host-anon-extra-gib 16": exit 3 when a bound is passed);
#   BR_RUN_ARGS goes to run_ptq (e.g. "--device-memory-gb 60": plan and allocate as on a 64-GB card).
# Results: everything under $RES ($BR_WORK/res); $OUT (the device tool's return folder, or
# /tmp/br_out) gets results.tgz (all of it), summary.txt and the profiles. State (checkpoints)
# in $BR_WORK (/tmp/br).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-/tmp/br_out}
W=${BR_WORK:-/tmp/br}
RES=$W/res
PY=${BR_PY:-python3}
mkdir -p "$OUT" "$W" "$RES"
export PYTHONPATH=$REPO PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/summary.txt"; }
# everything so far to $OUT: after every run, not only at the end, so a call cut by the device
# tool's limit still returns the runs it finished (casebook i34-16)
publish() {
  tar czf "$OUT/results.tgz" -C "$RES" . && cp "$RES/summary.txt" "$OUT/" && { cp "$RES"/prof_*.txt "$OUT/" 2>/dev/null; true; }
}

ckpt() {  # like out
  [ -f "$2/model.safetensors.index.json" ] && return 0
  rm -rf "$2"
  $PY tools/make_synthetic_checkpoint.py --like "$1" --layers 3 --no-mtp-block --out "$2" --device cuda \
      > "$RES/ckpt_$1.log" 2>&1 || { tail -5 "$RES/ckpt_$1.log"; return 2; }
  tail -1 "$RES/ckpt_$1.log"
}

run() {   # tag scheme algo [limit] [model]
  local tag=$1 scheme=$2 algo=$3 lim=${4:-300} model=${5:-flash}
  local like=v4-flash; [ "$model" = pro ] && like=v4-pro
  ckpt "$like" "$W/$model" || return 2
  rm -rf "$W/run_$tag"
  local prof=""; [ -n "${BR_PROFILE_STEP:-}" ] && prof="$BR_PROFILE_STEP:$RES/prof_$tag.txt"
  AMCT_PROFILE_BLOCKROUND=$prof timeout -s INT "$lim" $PY benchmarks/bench_ptq.py --device cuda --like "$like" \
      --model-path "$W/$model" --start-layer 2 --end-layer 3 --calib-samples 128 --seq-len 2048 \
      --workdir "$W/run_$tag" --json "$RES/$tag.json" ${BR_BENCH_ARGS:-} \
      -- --scheme "$scheme" --algo "$algo" --propagate quant ${BR_RUN_ARGS:-} > "$RES/$tag.log" 2>&1
  local rc=$?
  cp "$W/run_$tag/ptq_out/ptq_params/meta.json" "$RES/$tag.meta.json" 2>/dev/null
  rm -rf "$W/run_$tag"
  say "run $tag: rc=$rc"
  grep -E "blockround|^\[phase\] layer 2 (capture|solve|build|propagate)|^error|Error|BOUND|projection v4-flash" \
      "$RES/$tag.log" | grep -v "steps, " | tail -14 | tee -a "$RES/summary.txt"
  grep -E "steps, " "$RES/$tag.log" | tail -2 | tee -a "$RES/summary.txt"
  publish
}

for st in ${*:-env kernels ckpt}; do
  say "stage $st"
  case $st in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
         $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
         echo "tree $(git log -1 --format=%h 2>/dev/null) $(git status --short | wc -l) changed files";;
    kernels) $PY benchmarks/check_block_rounding_kernels.py --device cuda --json "$RES/br_kernels.json" \
                 > "$RES/br_kernels.log" 2>&1; grep -v Warn "$RES/br_kernels.log" | tail -26 | tee -a "$RES/summary.txt";;
    hc) $PY benchmarks/check_hc_autograd.py --device cuda --json "$RES/hc_autograd.json" --check \
            > "$RES/hc_autograd.log" 2>&1; echo "rc=$?" | tee -a "$RES/summary.txt"
        grep -E '"ms"|peak|speedup|accurate' "$RES/hc_autograd.log" | tee -a "$RES/summary.txt";;
    attn) $PY benchmarks/check_banded_attention.py --device cuda --json "$RES/banded_attention.json" --check \
              > "$RES/banded_attention.log" 2>&1; echo "rc=$?" | tee -a "$RES/summary.txt"
          grep -E '"ms"|peak|speedup|accurate|bit_for_bit|grad_|"out"' "$RES/banded_attention.log" | tee -a "$RES/summary.txt";;
    ckpt) ckpt v4-flash "$W/flash";;
    ckpt-pro) ckpt v4-pro "$W/pro";;
    rm-flash) rm -rf "$W/flash";;
    run@*) IFS=@ read -r _ tag scheme algo lim model <<< "$st"; run "$tag" "$scheme" "$algo" "${lim:-300}" "${model:-flash}";;
    start@*) IFS=@ read -r _ tag _ <<< "$st"
             setsid bash "${BASH_SOURCE[0]}" "run@${st#start@}" > "$W/start_$tag.out" 2>&1 < /dev/null &
             say "started ${st#start@} (pid $!)";;
    wait@*) IFS=@ read -r _ tag secs <<< "$st"; waited=0
            until grep -q "run $tag: rc=" "$RES/summary.txt" 2>/dev/null || [ "$waited" -ge "${secs:-560}" ]; do
              sleep 2; waited=$((waited + 2)); cp "$RES/$tag.log" "$OUT/$tag.partial.log" 2>/dev/null
            done
            grep -q "run $tag: rc=" "$RES/summary.txt" || say "run $tag: still running after ${waited} s";;
    *) echo "unknown stage $st"; exit 2;;
  esac
done
say "done"
publish
true
