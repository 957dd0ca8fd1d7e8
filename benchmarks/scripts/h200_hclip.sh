#!/usr/bin/env bash
# hclip (clip factors from the capture's Hessians, no stored call) on one V4-Flash ratio-4 layer at
# the default calibration 128 x 2048 (issue 24): the statistics-path candidates of each scheme whose
# default replays calls, through bench_ptq (the main job's own code path), one table at the end.
# Reuses h200_defaults.sh's checkpoint ($SYN) and table writer. Usage (GPU machine, repo root):
#   OUT=dir bash benchmarks/scripts/h200_hclip.sh
# Each row: "scheme|algo"; capture must store no call (capture_bytes 0 in the JSON's phases).
set -u
OUT=${OUT:-/tmp/out_hclip}; mkdir -p "$OUT"
SYN=${SYN:-/tmp/syn_flash}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -f "$SYN/model.safetensors.index.json" ] || python3 tools/make_synthetic_checkpoint.py --like v4-flash --layers 3 \
    --no-mtp-block --out "$SYN" --device cuda 2>&1 | tail -2
ROWS=${ROWS:-"w4a16-g128|hclip,gptq:sequential=false w4a16-g128|hclip:sweeps=2,gptq:sequential=false \
w3a16-g128|hclip,gptq:sequential=false w4a8|hclip:sweeps=2,gptq:sequential=false w4a16|hclip \
w2a16-g64|hclip:sweeps=2 fp8|hclip mxfp8|gptq:sequential=false"}
for row in $ROWS; do
  s=${row%%|*}; a=${row#*|}
  tag="$s-$(echo "$a" | tr ':=,' '___')"
  rm -rf /tmp/w_hclip
  t=$(date +%s)
  timeout -s INT "${LIMIT:-400}" python3 benchmarks/bench_ptq.py --device cuda --model-path "$SYN" --start-layer 2 \
      --end-layer 3 --calib-samples "${CALIB:-128}" --seq-len "${SEQ:-2048}" --workdir /tmp/w_hclip \
      --json "$OUT/def_$tag.json" --algo "$a" -- --scheme "$s" > "$OUT/def_$tag.log" 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t )) s"
  grep -E "solved jointly|solved in|^\[phase\]|capture_bytes|rss|peak" "$OUT/def_$tag.log" | tail -14
done
python3 benchmarks/scripts/defaults_table.py "$OUT"/def_*.json > "$OUT/hclip.md" 2>&1; cat "$OUT/hclip.md"
