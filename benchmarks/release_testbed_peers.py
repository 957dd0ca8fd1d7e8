#!/usr/bin/env python
"""The peers' side of the release testbed (issue 35.2): auto-round (and later llm-compressor /
msModelSlim) on the exact float dequantization of ``assets/tiny-v4-release``, against the release
float that benchmarks/release_testbed.py measured with the project's own code.

    python tools/dequantize_release.py --src assets/tiny-v4-release --out DEQ
    python benchmarks/peer_autoround.py --venv /work/venvs/autoround --model DEQ --eval-windows 1487 \\
        --allow-float-mismatch --schemes w4a16-g128 --seed 0 --threads 1 \\
        --json benchmarks/results/release-testbed-peers-autoround.json
    python benchmarks/release_testbed_peers.py            # -> benchmarks/results/release-testbed-peers.json

The summary is recomputed from the peers' raw JSON and the testbed's float cell only (no number is
typed in); ``check_md`` lists the summary numbers benchmarks/results/release-testbed-peers.md
fails to quote (tests/test_release_testbed_peers.py).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TESTBED = RESULTS / "release-testbed.json"
SUMMARY = RESULTS / "release-testbed-peers.json"
MD = RESULTS / "release-testbed-peers.md"
# raw JSON of each peer script run on the dequantized release: peer label -> file
RAW = {"auto-round": RESULTS / "release-testbed-peers-autoround.json",
       "llm-compressor": RESULTS / "release-testbed-peers-llmcompressor.json",
       "msModelSlim": RESULTS / "release-testbed-peers-msmodelslim.json"}
# peers issue 35.2 names that have no cell here yet (listed on the page as not run)
# `lscpu | grep 'Model name'` of the box the peer runs used (the raw JSON records only its class)
MACHINE_MODEL = "AMD EPYC"
NOT_RUN = ()
# what a peer's cell names mean, said under its table
NOTES = {"llm-compressor": (
    "`gptq-default` is llm-compressor's GPTQModifier at its own defaults (block 128, dampening 0.01, "
    "actorder static: recorded per cell as `gptq_knobs` in the raw JSON); `gptq` pins actorder to None "
    "as the issue-13 table did (the project's GPTQ has no activation ordering). Both use the project's "
    "scheme (w4a16-g128: asymmetric int4, groups of 128, min-max; w8a8: symmetric int8 per channel, "
    "dynamic per-token int8 activations, which for routed experts is one scale per tensor: "
    "casebook/peer-llm-compressor.md P5) on the project's targets; 16 x 256 calibration windows, seed 0, "
    "all experts calibrated (llm-compressor's default).",),
         "msModelSlim": (
    "`w8a8 flash-w8a8` / `w4a8 pro-w4a8` are msModelSlim's shipped recipes `lab_practice/deepseek_v4/"
    "deepseek_v4_flash_w8a8.yaml` (QuaRot + flex_smooth_quant, W8A8_DYNAMIC on wq_a / wkv / wq_b / indexer.wq_b "
    "and every expert) and `deepseek_v4_pro_w4a8.yaml` (QuaRot + flex_awq_ssz + flex_smooth_quant, routed experts "
    "W4A8_DYNAMIC per channel, shared expert and attention W8A8_DYNAMIC), run by its own CLI on CPU with only the "
    "`dataset` line changed (the project's 16 x 256 calibration windows as its jsonl); `wo_a`, `wo_b`, the "
    "compressors and the indexer's other linears stay FLOAT. The four workarounds it needs on the tiny (config "
    "fields, MTP off, no YaRN on ratio-0 layers, one dtype in its alpha search) are listed in the raw JSON and "
    "casebook/peer-msmodelslim.md. Its output is evaluated by the project's read-back of the exported folder: "
    "weights decoded from the codes, dynamic int8 per-token inputs on the W8A8_DYNAMIC / W4A8_DYNAMIC leaves only "
    "(what vllm-ascend computes; QuaRot is folded into the saved weights). Its float check is that evaluator "
    "on DEQ. Our w4a8 is int4 in groups of 128, msModelSlim's per channel (vllm-ascend's W4A8_DYNAMIC takes "
    "only per channel); our w8a8 also quantizes `wo_b` (weights and inputs), which msModelSlim's recipe keeps "
    "float. msModelSlim's own model, with the workarounds, computes the tiny: its bf16 last-position logits "
    "agree with our fp32 float model's to cosine > 0.9999, same argmax (`forward_check` in the raw JSON), "
    "and its output has the tensor layout and description of the earlier reference run "
    "(tests/data/msmodelslim-26.1-tiny-v4).",)}
DEQUANTIZE = "python tools/dequantize_release.py --src assets/tiny-v4-release --out DEQ"


def _command(raw_command: str, scheme: str | None, algo: str | None = None, json_path: Path | None = None) -> str:
    """The peer script's recorded argv with the model folder named DEQ and, per cell, its scheme
    (and algorithm, for a peer with several); ``--json`` names the committed raw file (a run split
    over processes wrote parts elsewhere and merged them into it)."""
    cmd = re.sub(r"--model \S+", "--model DEQ", "python benchmarks/" + raw_command.replace(str(REPO) + "/", ""))
    if json_path is not None:
        cmd = re.sub(r"--json \S+", f"--json {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}", cmd)
    if algo is not None:
        cmd = re.sub(r"--algos \S+", f"--algos {algo}", cmd)
        cmd = re.sub(r"--recipes \S+", f"--recipes {algo}", cmd)
    return cmd if scheme is None else re.sub(r"--schemes \S+", f"--schemes {scheme}", cmd)


def _cell_key_and_scheme(key: str, cell: dict) -> tuple[str, str]:
    """The summary's name of a raw cell and its scheme: auto-round keys cells by scheme,
    peer_llmcompressor.py by ``scheme|algo`` (and records ``scheme``), shown as ``scheme algo``."""
    scheme = cell.get("scheme", key.split("|")[0])
    return key.replace("|", " "), scheme


def _quantize_s(cell: dict) -> float:
    """Wall time of the peer's quantization: auto-round's ``quantize_s``, llm-compressor's ``oneshot_s``."""
    return cell["quantize_s"] if "quantize_s" in cell else cell["oneshot_s"]


def _pct(ppl: float, ref: float) -> float:
    return 100.0 * (ppl / ref - 1.0)


def summarize(testbed: dict, raws: dict[str, dict]) -> dict:
    """The summary from the testbed's JSON and each peer's raw JSON."""
    release = testbed["float"]["ppl"]
    out = {"release_float": {"ppl": release, "command": testbed["float"]["command"],
                             "source": "benchmarks/results/release-testbed.json"},
           "source_model": {"command": DEQUANTIZE,
                            "note": "exact: every FP8 / FP4 weight decoded to bf16 and checked equal to its "
                                    "fp32 decode (tests/test_dequantize_release.py)"},
           "peers": {}}
    for peer, raw in raws.items():
        f = raw["float"]
        entry = {"command": _command(raw["command"], None, json_path=RAW.get(peer)),
                 "versions": raw["versions"], "date": raw["date"], "machine": raw["machine"],
                 "eval_windows": raw["protocol"]["eval_windows"],
                 "eval_windows_sha256": raw["protocol"]["eval_windows_sha256"],
                 "float": {"ppl": f["ppl"], "vs_release_float_pct": _pct(f["ppl"], release)},
                 "processes": max(1, len(raw.get("commands", []))),
                 **({"float_what": f["what"]} if "what" in f else {}),
                 "cells": {}}
        for key, cell in raw["cells"].items():
            name, scheme = _cell_key_and_scheme(key, cell)
            if "error" in cell:
                entry["cells"][name] = {"error": cell["error"]}
                continue
            entry["cells"][name] = {"command": _command(raw["command"], scheme, cell.get("algo"), RAW.get(peer)), "ppl": cell["ppl"], "vs_release_float_pct": _pct(cell["ppl"], release),
                                    "vs_peer_float_pct": _pct(cell["ppl"], f["ppl"]),
                                    "quantize_s": _quantize_s(cell)}
            ours = testbed.get(f"{scheme}-default")   # the project's default on the same release, if run
            if ours is not None:
                entry["cells"][name]["ours_default"] = {"ppl": ours["ppl"],
                                                          "vs_release_float_pct": _pct(ours["ppl"], release)}
        out["peers"][peer] = entry
    return out


def quotes(summary: dict) -> list[str]:
    """The strings the markdown must contain: PPL to 3 decimals, percentages to 2."""
    want = [f"{summary['release_float']['ppl']:.3f}"]
    for entry in summary["peers"].values():
        want.append(f"{entry['float']['ppl']:.3f}")
        for cell in entry["cells"].values():
            if "ppl" in cell:
                want += [f"{cell['ppl']:.3f}", f"{cell['vs_release_float_pct']:+.2f} %"]
                if "ours_default" in cell:
                    want += [f"{cell['ours_default']['ppl']:.3f}", f"{cell['ours_default']['vs_release_float_pct']:+.2f} %"]
    return want


def check_md(md: Path, summary: dict) -> list[str]:
    """Numbers of ``summary`` that ``md`` does not quote (empty = consistent)."""
    text = md.read_text()
    return [q for q in quotes(summary) if q not in text]


def render_md(summary: dict) -> str:
    """The markdown page: how the source was made, the float check, one row per peer cell."""
    rf = summary["release_float"]
    lines = ["# Peers on the release testbed: the exact float dequantization of the release-format tiny", "",
             "Issue 35.2's peers \"on the same model, from its exact bf16 dequantization\": the peers start from "
             "a float checkpoint, so `assets/tiny-v4-release` is decoded by the project's own FP8 / FP4 "
             "decoders and written in `assets/tiny-v4`'s layout (same keys, dtypes and config):", "",
             "```", summary["source_model"]["command"], "```", "",
             "Every decoded weight is exact in bf16 (e4m3 has 4 significant bits, e2m1 2, a ue8m0 scale is a "
             "power of two, bf16 keeps 8; the tool checks each tensor and would refuse otherwise). Our float "
             "model from that folder gives the release's logits bit for bit "
             "(`tests/test_dequantize_release.py`).", "",
             f"The reference is the release float measured by the project on the whole test split: "
             f"**{rf['ppl']:.3f}** (`{rf['command']}`, [release-testbed.json](release-testbed.json)).", ""]
    for peer, e in summary["peers"].items():
        v = e["versions"]
        # the versions record names the package as pip does ("llmcompressor" for llm-compressor)
        version = v.get(peer, v.get(peer.replace("-", ""), v.get(peer.lower(), "")))
        # which float model the peer's float check ran (recorded by the peer script when not transformers')
        float_what = e.get("float_what", "transformers' DeepseekV4 on DEQ")
        lines += [f"## {peer} {version}", "",
                  f"- Command (last run; each cell's is in the JSON): `{e['command']}` (DEQ = the folder above).",
                  f"- Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + f"; {e['machine'].get('description', e['machine'])}, lscpu {MACHINE_MODEL}; "
                  f"{e['date']}; fp32, CPU, one thread, shared with other jobs (times are not comparable).",
                  f"- Evaluation: {e['eval_windows']} windows x 256 (the whole test split, the testbed's windows: "
                  f"same sha256 `{e['eval_windows_sha256'][:16]}...`).",
                  f"- Float check: {float_what} gives **{e['float']['ppl']:.3f}**, "
                  f"{e['float']['vs_release_float_pct']:+.5f} % from the release float "
                  f"(relative {e['float']['vs_release_float_pct'] / 100:.1e}).",
                  *([f"- Run split over {e['processes']} processes (one per cell, `--threads 1` each), the float "
                     "check made once and copied into the other parts, merged with the script's `--merge`."]
                    if e.get("processes", 1) > 1 else []), "",
                  "| scheme | PPL | vs release float | vs the peer's own float | quantize s | ours (default), vs release float |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for scheme, c in e["cells"].items():
            if "ppl" not in c:
                lines.append(f"| {scheme} | failed: {c['error'][:120]} | | | | |")
                continue
            o = c.get("ours_default")
            ours = f"{o['ppl']:.3f}, {o['vs_release_float_pct']:+.2f} %" if o else "not run"
            lines.append(f"| {scheme} | {c['ppl']:.3f} | {c['vs_release_float_pct']:+.2f} % | "
                         f"{c['vs_peer_float_pct']:+.2f} % | {c['quantize_s']:.0f} | {ours} |")
        lines += ["", *(x for n in NOTES.get(peer, ()) for x in (n, "")), "`ours (default)` is the project's default recipe on the release itself "
                  "(benchmarks/release_testbed.py's `SCHEME-default` cell, the same windows), for reading the "
                  "peer's number beside it.", ""]
    if NOT_RUN:
        lines += ["## Not run", "", "On the dequantized release, not measured yet: " + "; ".join(NOT_RUN) + ".", ""]
    return "\n".join(lines) + "\n"


def load_raws() -> dict[str, dict]:
    return {peer: json.loads(path.read_text()) for peer, path in RAW.items() if path.is_file()}


def main(argv=None) -> int:
    from amct_ext.io.io_utils import atomic_write_json

    summary = summarize(json.loads(TESTBED.read_text()), load_raws())
    atomic_write_json(summary, SUMMARY)
    if "--md" in (argv if argv is not None else sys.argv[1:]):
        from amct_ext.io.io_utils import atomic_write

        atomic_write(MD, lambda tmp: Path(tmp).write_text(render_md(summary)))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
