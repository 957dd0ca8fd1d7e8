#!/usr/bin/env bash
# The PTQ time of one real-size layer per recipe, side by side, on one H200 (written for issue 24
# item 4; the table is RESULTS.md §2). A 3-layer synthetic V4-Flash checkpoint
# (layer 2: compress ratio 4, hash routing, compressor + indexer: the slowest kind), then on
# layer 2 at the default calibration: every built-in scheme's DEFAULT recipe (bench_ptq), GPTQ
# (sequential and sequential=false) at 8 / 32 / 128 windows, llm-compressor 0.14's GPTQ on the
# same layer and windows (wheels carried, bf16 copy of the checkpoint), and ONE table with the
# floors and the V4-Flash projection (benchmarks/scripts/recipe_speed_table.py).
#
# Usage (repository root; state in $RS, default /tmp/recipe_speed, kept between calls while the machine
# stays warm; every stage done is skipped on the next call, so the SAME command is repeated
# until it prints "all stages done"):
#   bash benchmarks/scripts/h200_recipe_speed.sh [STAGE_OR_GROUP ...]      # default group: all
#   RS_SMALL=1 bash benchmarks/scripts/h200_recipe_speed.sh              # CPU, tiny dims, minutes
# Groups: all = prep ours peer table; prep = env ckpt wheels probe; ours = gptq defaults alts;
# gptq = gptq-nseq-128 gptq-seq-128 gptq-nseq-8 gptq-nseq-32 gptq-seq-8 gptq-seq-32;
# defaults = def-<scheme> for $RS_SCHEMES; alts = alt-1 .. alt-N from $RS_ALTS;
# peer = bf16 llmc-8 llmc-32 llmc-128 rmbf16. A call stops starting stages once the next one's
# estimate would pass $RS_CALL_BUDGET (540 s) since the call began ("deferred": call again);
# every run of ours is cut at its stage's limit (timeout -s INT: the table reads how far it got).
# Results: $RS/res (JSON + logs), the table $RS/res/recipe_speed.{md,json}, and copies of the table
# plus a results tarball under $OUT (the device tool's return folder) after every call.
# The device keeps $RS only while warm (KINDS.md: 30 s after a call): issue the next call at
# once. If it went back, carry the last recipe_speed_results.tgz (e.g. copied to .dev/recipe_speed/) and set
# RS_SEED=.dev/recipe_speed/recipe_speed_results.tgz: its results are restored and their stages count as done
# (the checkpoint, wheels and probe are simply redone, ~85 s).
#
# Environment (defaults in brackets; RS_SMALL=1 switches to the CPU/tiny column):
#   RS_LAYERS_CKPT [3]  RS_LAYER [2]  RS_CALIB [128 | 4]  RS_SEQ [2048 | 64]
#   RS_WINDOWS ["8 32 128" | "2 4 8"]   RS_REPEATS [1]: runs per stage (table: median, min-max)
#   RS_SCHEMES [every built-in scheme with weights, i.e. builtin_schemes() minus kv8, kv8-fp8]
#   RS_ALTS ["": ';'-separated "SCHEME RUN_PTQ_ARGS", e.g. "w4a16-g128 --recipe best;w8a8 --algo clip"]
#   RS_SEQ_WINDOWS [$RS_WINDOWS]: the windows of gptq-seq-* (the last window count always runs)
#   RS_GPTQ_SCHEME [w8a8]  RS_LLMC_ROUTED_ONLY [0]: 1 = moe_calibrate_all_experts=False
#   RS_LIMIT_DEF [110] RS_LIMIT_GPTQ [150] RS_LIMIT_LLMC [330] RS_LIMIT_ALT [$RS_LIMIT_DEF]: seconds per run
#   RS_PY [python3]  RS_LLMC_PY [""]: a python with llmcompressor (CPU: /work/venvs/llmc/bin/python);
#   empty = $RS_PY with PYTHONPATH=$RS/site, filled by stage wheels from $RS_WHEELS [.dev/wheels-llmc]
#   RS_BF16_DIR [$RS/bf16]  RS_KEEP_BF16 [0]  RS_REDO [0]: rerun stages already done
#   RS_SEED [""]: a results tarball of an earlier call to restore (see above)  RS_CALL_BUDGET [540]
#
# PLAN, one H200, full scale (estimates: history/RESULTS-2026-12-04.md §0.5 / §0.8 / §0.9 and the issue's figures;
# "warm" = a later run of the same machine, page cache filled; each run of bench_ptq pays ~30 s
# outside the layer: imports, embedding, float layers 0-1, probes):
#   stage            est. s  from
#   env + ckpt           45  make_synthetic_checkpoint 29-36 s (13.03 GiB)
#   wheels               30  pip --no-deps of ~14 small wheels + one import of llmcompressor (13 s here)
#   probe                15  bf16 / fp32 matmul rate, h2d and d2d bandwidth
#   def-w8a8, -mxfp4     60  rtn: wall 55-96 s
#   def-<clip/gptq/      110 each (the limit): a default that meets the 60 s target ends in ~100 s;
#     autoround>               today clip,gptq > 280 s and autoround ~6 min: stopped at the limit
#   gptq-nseq-8/32/128   75 / 75 / 110  §0.9: 93 s wall at 128 (capture 32, solve 17, write 11)
#   gptq-seq-8/32/128    70 / 90 / 150  §0.9: not measured at 128 (its 580 s limit ended it in capture)
#   bf16                100  read 13 GiB, write ~40 GiB (disk: 13 + 40 of 64 GiB; checked first)
#   llmc-8/32/128       84 / 110 / 216  import 15 + load ~45 + oneshot 20.6 / 45.1 s (issue) / ~143 s
#                                   (linear in the windows: 12.4 s + 1.02 s a window)
#   rmbf16, table         5
# Calls (each <= 540 s; the SAME command continues where the last one stopped). Full run:
#   1. prep + def-w8a8 + gptq-nseq-128 + gptq-seq-128 + def-fp8         ~ 500 s
#   2. def-mxfp4 -mxfp8 -w2a16-g64 -w3a16-g128 -w4a16                   ~ 500 s
#   3. def-w4a16-g128 -w4a8 + gptq-nseq-8 -32                            ~ 400 s
#   4. gptq-seq-8 -32 + bf16 + llmc-8                                    ~ 490 s
#   5. llmc-32 + llmc-128 + rmbf16 + table                               ~ 330 s
#   = ~37 min at the limits: over the ~20 min budget. The lean run (what to cut, in this order):
#   a) RS_SCHEMES="w8a8 w4a16-g128 w3a16-g128 w4a16": one default per distinct default recipe
#      (rtn: also mxfp4; clip,gptq: also w4a8, mxfp8; clip: also fp8, w2a16-g64): -5 x ~100 s;
#   b) RS_SEQ_WINDOWS=128: sequential GPTQ at 128 windows only (its target row): -2 x ~150 s;
#   giving 3 calls:
#   1. prep + def-w8a8 + gptq-nseq-128 + gptq-seq-128 + def-w4a16-g128   ~ 500 s
#   2. def-w3a16-g128 + def-w4a16 + gptq-nseq-8 -32 + bf16               ~ 500 s
#   3. llmc-8 + llmc-32 + llmc-128 + rmbf16 + table                      ~ 410 s
#   = ~24 min at the limits; less where runs end before their limit (a default that meets its
#   60 s target ends in ~100 s, not 110; rtn in ~55 s). Then c) RS_LIMIT_DEF=90 (-60 s), and
#   d) RS_WINDOWS="8 128" (drops the 32-window rows: -~200 s) if still over.
set -u
# The variables were called I24_* before the script was named for what it measures: refuse them
# (one line) rather than run the defaults silently with a setting ignored.
old_vars=$(env | sed -n 's/^\(I24[A-Z0-9_]*\)=.*/\1/p' | tr '\n' ' ')
if [ -n "$old_vars" ]; then
  echo "error: ${old_vars% }: renamed RS_* (e.g. I24_SCHEMES -> RS_SCHEMES, I24 -> RS); unset them" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
RS=${RS:-/tmp/recipe_speed}
SMALL=${RS_SMALL:-0}
if [ "$SMALL" = 1 ]; then
  LIKE=tiny; DEVICE=${RS_DEVICE:-cpu}; CALIB=${RS_CALIB:-4}; SEQ=${RS_SEQ:-64}; WINDOWS=${RS_WINDOWS:-"2 4 8"}
  SCALE=0   # estimates: small
  # the tiny dims widened to assets/tiny-v4's (hidden 128, ...): every targeted input dim a
  # multiple of 128, as the group-128 schemes need (the synthetic tiny has hidden 64)
  CKPT_OVERRIDES="--override hidden_size=128 --override head_dim=64 --override qk_rope_head_dim=16
    --override q_lora_rank=128 --override o_lora_rank=64 --override moe_intermediate_size=256 --override index_head_dim=32"
else
  LIKE=v4-flash; DEVICE=${RS_DEVICE:-cuda}; CALIB=${RS_CALIB:-128}; SEQ=${RS_SEQ:-2048}
  WINDOWS=${RS_WINDOWS:-"8 32 128"}; SCALE=1; CKPT_OVERRIDES=
fi
LAYERS_CKPT=${RS_LAYERS_CKPT:-3}; L=${RS_LAYER:-2}
REPEATS=${RS_REPEATS:-1}
PY=${RS_PY:-python3}
LLMC_PY=${RS_LLMC_PY:-}
WHEELS=${RS_WHEELS:-.dev/wheels-llmc}
GPTQ_SCHEME=${RS_GPTQ_SCHEME:-w8a8}
LIMIT_DEF=${RS_LIMIT_DEF:-110}; LIMIT_GPTQ=${RS_LIMIT_GPTQ:-150}; LIMIT_LLMC=${RS_LIMIT_LLMC:-330}
LIMIT_ALT=${RS_LIMIT_ALT:-$LIMIT_DEF}   # --recipe best runs take minutes: give them their own limit
[ "$SMALL" = 1 ] && { LIMIT_DEF=${RS_LIMIT_DEF:-900}; LIMIT_GPTQ=${RS_LIMIT_GPTQ:-900}; LIMIT_LLMC=${RS_LIMIT_LLMC:-900}; }
BUDGET=${RS_CALL_BUDGET:-540}
[ "$SMALL" = 1 ] && BUDGET=${RS_CALL_BUDGET:-100000}
RES=$RS/res; DONE=$RS/done; WORK=$RS/work; CKPT=$RS/ckpt; SITE=$RS/site
BF16=${RS_BF16_DIR:-$RS/bf16}
mkdir -p "$RES" "$DONE" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s)
DEFERRED=()
# A machine that went back (idle) lost $RS: RS_SEED=path/recipe_speed_results.tgz (what an earlier call
# returned under $OUT, carried back) restores the results and marks their stages done
if [ -n "${RS_SEED:-}" ] && [ ! -f "$RES/.seeded" ]; then
  if [ -f "$RS_SEED" ]; then
    tar -xzf "$RS_SEED" -C "$RS" --skip-old-files res && touch "$RES/.seeded"
    for j in "$RES"/ours_*.r1.json; do [ -f "$j" ] || continue; t=${j##*/ours_}; touch "$DONE/${t%.r1.json}"; done
    for j in "$RES"/llmc_*.r1.json; do grep -q '"oneshot_s"' "$j" 2>/dev/null || continue; t=${j##*/llmc_}; touch "$DONE/llmc-${t%.r1.json}"; done
    echo "seeded from $RS_SEED: $(ls "$DONE" | tr '\n' ' ')"
  else echo "warning: RS_SEED=$RS_SEED: no such file"; fi
fi
elapsed() { echo $(( $(date +%s) - T0 )); }

schemes() {   # every built-in scheme that has weights (the cache-only ones have no recipe to run)
  if [ -n "${RS_SCHEMES:-}" ]; then echo "$RS_SCHEMES"; return; fi
  PYTHONPATH=$REPO $PY -c "from amct_ext.quant.schemes import builtin_schemes, load_scheme
print(' '.join(s for s in builtin_schemes() if any(t.weight is not None for t in load_scheme(s).targets.values())))"
}
alts() { [ -n "${RS_ALTS:-}" ] && echo "$RS_ALTS" | tr ';' '\n' | sed '/^ *$/d'; }

expand() {    # groups -> stage names, in order
  local g
  for g in "$@"; do
    case $g in
      all) expand prep ours peer table ;;
      prep) echo env ckpt wheels probe ;;
      ours) expand gptq-first defaults gptq-rest alts ;;
      gptq-first) echo "def-$(first_scheme)"; for w in $(last_window); do echo gptq-nseq-$w gptq-seq-$w; done ;;
      gptq-rest) for w in $(other_windows); do echo gptq-nseq-$w; done
                 for w in $(other_windows); do case " ${RS_SEQ_WINDOWS:-$WINDOWS} " in *" $w "*) echo gptq-seq-$w ;; esac; done ;;
      gptq) expand gptq-first gptq-rest ;;
      defaults) for s in $(schemes); do echo "def-$s"; done ;;
      alts) local i=0; while IFS= read -r _; do i=$((i + 1)); echo "alt-$i"; done < <(alts) ;;
      peer) echo bf16; for w in $WINDOWS; do echo llmc-$w; done; echo rmbf16 ;;
      *) echo "$g" ;;
    esac
  done
}
first_scheme() { local s; s=$(schemes); case " $s " in *" w8a8 "*) echo w8a8 ;; *) echo "${s%% *}" ;; esac; }
last_window() { echo "$WINDOWS" | tr ' ' '\n' | sed '/^$/d' | tail -1; }
other_windows() { echo "$WINDOWS" | tr ' ' '\n' | sed '/^$/d' | sed '$d'; }

est() {       # full-scale seconds of a stage (small mode: a token 1 s; its budget is unlimited)
  [ "$SCALE" = 0 ] && { echo 1; return; }
  case $1 in
    env) echo 5 ;; ckpt) echo 40 ;; wheels) echo 30 ;; probe) echo 15 ;; bf16) echo 100 ;; rmbf16|table) echo 5 ;;
    def-w8a8|def-mxfp4) echo 60 ;; def-*) echo "$LIMIT_DEF" ;; alt-*) echo "$LIMIT_ALT" ;;
    gptq-nseq-*) [ "${1#gptq-nseq-}" -ge 128 ] && echo 110 || echo 75 ;;
    # statistics path now (stage re-runs of the layer, no stored calls): like sequential=false + ~3 forwards
    gptq-seq-*) [ "${1#gptq-seq-}" -ge 128 ] && echo "$LIMIT_GPTQ" || echo 90 ;;
    llmc-*) local w=${1#llmc-}; echo $(( 75 + w * 11 / 10 )) ;;   # import 15 + load ~45 + 12.4 s + 1.02 s a window (issue)
    *) echo 30 ;;
  esac
}

limit_for() {  # a run's time limit: its cap, but never past the call's budget
  local cap=$1 left=$(( BUDGET - $(elapsed) ))   # BUDGET (540) leaves the tool's 600 s a margin
  [ "$left" -lt "$cap" ] && cap=$left
  [ "$cap" -lt 10 ] && cap=10
  echo "$cap"
}

disk_ok() {   # a run of ours writes its layer (and may spill calls) under $WORK: refuse early when full
  local free_gib
  free_gib=$(df -Pk "$WORK" | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gib:-0}" -lt "${RS_MIN_FREE_GIB:-16}" ]; then
    echo "error: $WORK has ${free_gib} GiB free (< ${RS_MIN_FREE_GIB:-16}): the bf16 copy ($BF16, ~40 GiB) is still there?" \
         "run the llmc stages and rmbf16 before more runs of ours (casebook i24-or-4)"
    return 1
  fi
}

bench() {     # tag, limit, calib samples, bench_ptq args... (one bench_ptq run per repeat)
  local tag=$1 cap=$2 n=$3; shift 3
  local r rc=0
  disk_ok || return 2
  for r in $(seq 1 "$REPEATS"); do
    local j="$RES/ours_$tag.r$r.json" lim
    [ -f "$j" ] && [ "${RS_REDO:-0}" != 1 ] && { echo "  $tag r$r: kept"; continue; }
    lim=$(limit_for "$cap")
    rm -rf "$WORK/$tag"
    local t=$(date +%s)
    timeout -s INT "$lim" $PY benchmarks/bench_ptq.py --device "$DEVICE" --model-path "$CKPT" --start-layer "$L" \
        --end-layer $((L + 1)) --calib-samples "$n" --seq-len "$SEQ" --workdir "$WORK/$tag" --json "$j" \
        $([ "$SMALL" = 1 ] && echo --matmul-n 256) "$@" \
        > "$RES/ours_$tag.r$r.log" 2>&1
    rc=$?
    cp "$WORK/$tag/ptq_out/ptq_params/meta.json" "$RES/ours_$tag.r$r.meta.json" 2>/dev/null
    rm -rf "$WORK/$tag"   # disk: call-replaying recipes spill their calls there
    echo "  $tag r$r: rc=$rc (limit $lim s) wall $(( $(date +%s) - t )) s"
    grep -E "^\[phase\] layer $L (capture|solve)|unit seconds|^projection v4-flash|^error|Error" "$RES/ours_$tag.r$r.log" | tail -6
    # a failed run (not one stopped by its limit) leaves no result: the next call redoes it
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || [ "$rc" = 130 ] || { mv "$j" "$j.failed" 2>/dev/null; return "$rc"; }
  done
  return 0
}

st_env() {
  { date -u '+%Y-%m-%d %H:%M UTC'; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU (nvidia-smi)";
    $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)";
    echo "$(getconf _NPROCESSORS_ONLN) cores, host memory $(free -g | awk '/^Mem:/ {print $2}') GiB, disk free at $RS: $(df -h "$RS" | awk 'NR == 2 {print $4}')";
    echo "tree $(git -C "$REPO" log -1 --format='%h' 2>/dev/null || echo '?')"; } > "$RES/env.txt" 2>&1
  cat "$RES/env.txt"
}

st_ckpt() {
  [ -f "$CKPT/model.safetensors.index.json" ] && return 0
  rm -rf "$CKPT"
  PYTHONPATH=$REPO $PY tools/make_synthetic_checkpoint.py --like "$LIKE" --layers "$LAYERS_CKPT" --no-mtp-block \
      --out "$CKPT" --device "$DEVICE" $CKPT_OVERRIDES > "$RES/ckpt.log" 2>&1 || { tail -3 "$RES/ckpt.log"; return 2; }
  tail -1 "$RES/ckpt.log"
  cp "$CKPT/config.json" "$RES/ckpt_config.json"   # the table's floors, also where the checkpoint is gone
}

llmc_python() {  # the command prefix that runs python with llmcompressor importable
  if [ -n "$LLMC_PY" ]; then echo "env PYTHONPATH=$REPO $LLMC_PY"; else echo "env PYTHONPATH=$SITE:$REPO $PY"; fi
}

st_wheels() {
  if [ -z "$LLMC_PY" ]; then
    [ -d "$WHEELS" ] || { echo "error: $WHEELS: no wheel folder (carry it: run(..., carry=['$WHEELS']))"; return 2; }
    $PY benchmarks/scripts/install_wheels.py "$WHEELS" "$SITE" llmcompressor --json "$RES/wheels.json" || return 2
  fi
  local t=$(date +%s)
  $(llmc_python) -c "import llmcompressor, compressed_tensors, datasets
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from llmcompressor.modeling.moe.linearize import linearize_moe
import importlib.metadata as m
print('import ok: llmcompressor', m.version('llmcompressor'), 'compressed-tensors', m.version('compressed-tensors'),
      'transformers', m.version('transformers'), 'torch', m.version('torch'))" 2>&1 | tail -1 | tee "$RES/llmc_import.txt"
  grep -q "^import ok" "$RES/llmc_import.txt" || return 2
  echo "  import took $(( $(date +%s) - t )) s"
}

st_probe() {
  PYTHONPATH=$REPO $PY benchmarks/scripts/recipe_speed_table.py --probe "$RES/rates.json" --device "$DEVICE" \
      $([ "$SMALL" = 1 ] && echo --small)
}

st_def() {   # scheme
  bench "def-$1" "$LIMIT_DEF" "$CALIB" -- --scheme "$1"
}

st_alt() {   # index into $RS_ALTS: "SCHEME RUN_PTQ_ARGS"
  local line scheme args
  line=$(alts | sed -n "${1}p")
  [ -n "$line" ] || { echo "error: RS_ALTS has no entry $1"; return 2; }
  scheme=${line%% *}; args=${line#"$scheme"}
  echo "$line" > "$RES/ours_alt-$1.what"
  # shellcheck disable=SC2086
  bench "alt-$1" "$LIMIT_ALT" "$CALIB" -- --scheme "$scheme" $args
}

st_gptq() {  # seq|nseq, windows
  local algo=gptq cap=$LIMIT_GPTQ
  [ "$1" = nseq ] && { algo=gptq:sequential=false; cap=$(( LIMIT_GPTQ > 120 ? LIMIT_GPTQ : 120 )); }
  bench "gptq-$1-$2" "$cap" "$2" --algo "$algo" -- --scheme "$GPTQ_SCHEME"
}

st_bf16() {
  PYTHONPATH=$REPO $PY benchmarks/scripts/release_to_bf16.py "$CKPT" "$BF16" --device "$DEVICE" \
      > "$RES/bf16.log" 2>&1; local rc=$?
  tail -2 "$RES/bf16.log"; return $rc
}

st_llmc() {  # windows
  local w=$1 r rc=0
  [ -f "$BF16/model.safetensors.index.json" ] || { echo "error: no bf16 copy at $BF16 (stage bf16)"; return 2; }
  for r in $(seq 1 "$REPEATS"); do
    local j="$RES/llmc_$w.r$r.json" lim meta
    [ -f "$j" ] && grep -q '"oneshot_s"' "$j" && [ "${RS_REDO:-0}" != 1 ] && { echo "  llmc-$w r$r: kept"; continue; }
    lim=$(limit_for "$LIMIT_LLMC")
    meta=$(ls "$RES"/ours_gptq-nseq-$w.r*.meta.json "$RES"/ours_gptq-seq-$w.r*.meta.json 2>/dev/null | head -1)
    local t=$(date +%s)
    # shellcheck disable=SC2046
    timeout -s INT "$lim" $(llmc_python) benchmarks/peer_llmcompressor_layer.py --model "$BF16" --layer "$L" \
        --windows "$w" --seq-len "$SEQ" --device "$DEVICE" --scheme "$GPTQ_SCHEME" --json "$j" \
        $([ -n "$meta" ] && echo --ours-meta "$meta") $([ "${RS_LLMC_ROUTED_ONLY:-0}" = 1 ] && echo --routed-only) \
        $([ "$SMALL" = 1 ] && echo --threads 1) > "$RES/llmc_$w.r$r.log" 2>&1
    rc=$?
    echo "  llmc-$w r$r: rc=$rc (limit $lim s) wall $(( $(date +%s) - t )) s"
    grep -E "^\[phase\]|^llm-compressor|^error" "$RES/llmc_$w.r$r.log" | tail -4
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || return "$rc"
  done
}

st_rmbf16() {  # only once every llm-compressor stage is done: a deferred one still needs the copy
  local w
  for w in $WINDOWS; do [ -f "$DONE/llmc-$w" ] || { echo "  kept $BF16: llmc-$w not done yet"; return 3; }; done
  [ "${RS_KEEP_BF16:-0}" = 1 ] || rm -rf "$BF16"
}

st_table() {
  PYTHONPATH=$REPO $PY benchmarks/scripts/recipe_speed_table.py --results "$RES" --layer "$L" --gptq-scheme "$GPTQ_SCHEME" \
      --md "$RES/recipe_speed.md" --json "$RES/recipe_speed.json" > "$RES/table.log" 2>&1 || { tail -5 "$RES/table.log"; return 2; }
  cat "$RES/recipe_speed.md"
}

run_stage() {
  local s=$1 e rc
  if [ -f "$DONE/$s" ] && [ "${RS_REDO:-0}" != 1 ]; then echo "[$s] done before"; return 0; fi
  e=$(est "$s")
  # after a deferral only the independent runs of ours may go ahead of it (the peer stages,
  # the copy and its removal keep their order)
  [ "$s" = table ] && { echo "[table] written at the end of the call"; return 0; }
  if [ ${#DEFERRED[@]} -gt 0 ]; then case $s in def-*|alt-*|gptq-*) ;; *)
    echo "[$s] deferred (after ${DEFERRED[0]})"; DEFERRED+=("$s"); return 0 ;; esac; fi
  if [ $(( $(elapsed) + e )) -gt "$BUDGET" ]; then echo "[$s] deferred (estimate $e s, $(elapsed) s used of $BUDGET)"; DEFERRED+=("$s"); return 0; fi
  echo "[$s] start at $(elapsed) s (estimate $e s)"
  case $s in
    env) st_env ;; ckpt) st_ckpt ;; wheels) st_wheels ;; probe) st_probe ;; bf16) st_bf16 ;;
    rmbf16) st_rmbf16 ;; table) st_table; return 0 ;;   # rewritten after every call anyway
    def-*) st_def "${s#def-}" ;;
    alt-*) st_alt "${s#alt-}" ;;
    gptq-nseq-*) st_gptq nseq "${s#gptq-nseq-}" ;;
    gptq-seq-*) st_gptq seq "${s#gptq-seq-}" ;;
    llmc-*) st_llmc "${s#llmc-}" ;;
    *) echo "error: unknown stage $s"; return 2 ;;
  esac
  rc=$?
  if [ "$rc" = 0 ]; then touch "$DONE/$s"; echo "[$s] done at $(elapsed) s"
  elif [ "$rc" = 3 ]; then echo "[$s] not yet (waits for another stage)"
  else echo "[$s] FAILED rc=$rc at $(elapsed) s"; fi
  return 0
}

STAGES=$(expand "${@:-all}")
echo "stages: $(echo $STAGES)"
for s in $STAGES; do
  case $s in ckpt|env|wheels|probe) ;; *)
    [ "$s" != table ] && [ ! -f "$DONE/$s" ] && [ ! -f "$CKPT/model.safetensors.index.json" ] && \
      { echo "[$s] needs the checkpoint: running ckpt first"; run_stage ckpt; } ;;
  esac
  run_stage "$s"
done
# the table (and what comes back) after every call, whatever was asked
st_table > /dev/null 2>&1 && echo "table: $RES/recipe_speed.md"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$RES/recipe_speed.md" "$RES/recipe_speed.json" "$OUT/" 2>/dev/null
  tar -czf "$OUT/recipe_speed_results.tgz" -C "$RS" res 2>/dev/null
fi
if [ ${#DEFERRED[@]} -gt 0 ]; then echo "deferred to the next call: ${DEFERRED[*]}"; else
  left=$(for s in $STAGES; do [ "$s" = table ] || [ -f "$DONE/$s" ] || echo "$s"; done)
  [ -z "$left" ] && echo "all stages done" || echo "not done (failed): $(echo $left)"; fi
