#!/usr/bin/env bash
# GPTQ's solve on one V4-Flash ratio-4 layer at the default calibration, before / after issue 24's
# lean sweep (RESULTS §0.9). Run from the AFTER tree; BEFORE=path of the before tree (optional).
# 1. benchmarks/bench_gptq_sweep.py: one chunk of 16 V4-Flash w1/w3 experts (4096 x 4096 each),
#    graphed == eager == the frozen reference loop, bit for bit on the device, and their times;
# 2. a 3-layer synthetic V4-Flash checkpoint; bench_ptq on layer 2 (128 x 2048) for w8a8 with its
#    default (rtn), --algo gptq:sequential=false and --algo gptq, after (and before, sequential=false);
# 3. the written layer of sequential=false before vs after, tensor by tensor.
# Usage: OUT=dir BEFORE=../gptq-speed-before bash benchmarks/scripts/h200_gptq_speed.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SYN=${SYN:-/tmp/syn_flash}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
timeout 120 python3 benchmarks/bench_gptq_sweep.py --device cuda --experts 16 --rows 4096 --cols 4096 \
    --repeats 2 --json "$OUT/sweep.json"; echo "sweep rc=$?"
t0=$(date +%s)
[ -f "$SYN/model.safetensors.index.json" ] || python3 tools/make_synthetic_checkpoint.py --like v4-flash --layers 3 \
    --no-mtp-block --out "$SYN" --device cuda 2>&1 | tail -2
echo "checkpoint ready: $(( $(date +%s) - t0 )) s"
run() {   # tree, tag, limit, bench args...
  local tree=$1 tag=$2 limit=$3; shift 3
  rm -rf "/tmp/w_$tag"
  local t=$(date +%s)
  ( cd "$tree" && timeout -s INT "$limit" python3 benchmarks/bench_ptq.py --device cuda --model-path "$SYN" \
      --start-layer 2 --end-layer 3 --calib-samples "${CALIB:-128}" --seq-len "${SEQ:-2048}" --workdir "/tmp/w_$tag" \
      --json "$OUT/$tag.json" "$@" 2>&1 ) | grep -E "solved|^\[phase\]|unit seconds|peak|error|Error|gptq" | tail -20
  echo "$tag rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - t )) s"
}
run . after_rtn 120 -- --scheme w8a8
rm -rf /tmp/w_after_rtn
run . after_seqfalse 150 --algo gptq:sequential=false -- --scheme w8a8
if [ -n "${BEFORE:-}" ]; then
  run "$BEFORE" before_seqfalse 150 --algo gptq:sequential=false -- --scheme w8a8
  python3 - <<'PY'
import pathlib, torch
a, b = pathlib.Path("/tmp/w_after_seqfalse/ptq_out"), pathlib.Path("/tmp/w_before_seqfalse/ptq_out")
def flat(x, pre=""):
    if isinstance(x, torch.Tensor):
        yield pre, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from flat(v, f"{pre}.{k}")
n = same = 0
for f in sorted(a.rglob("*.pt")):          # the layer's parameters (params/layer_*.pt)
    g = b / f.relative_to(a)
    if not g.exists():
        print("missing before:", f.relative_to(a)); continue
    ta = dict(flat(torch.load(f, map_location="cpu", weights_only=True)))
    tb = dict(flat(torch.load(g, map_location="cpu", weights_only=True)))
    for k, v in ta.items():
        n += 1
        same += bool(k in tb and v.shape == tb[k].shape and torch.equal(v, tb[k]))
print(f"compare sequential=false after vs before: {same} of {n} tensors bit-identical")
PY
fi
rm -rf /tmp/w_after_seqfalse /tmp/w_before_seqfalse   # disk: the sequential run stores the calls
run . after_seq "${SEQ_LIMIT:-200}" --algo gptq -- --scheme w8a8
