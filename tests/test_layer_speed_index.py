"""RESULTS.md (the index) quotes its real-size figures from the committed records: every row of
§2's per-recipe table from its run folder (the table JSON of benchmarks/scripts/recipe_speed_table.py,
or the block-rounding run's own JSON and log), the V4-Pro layer and the export medians from their
JSONs, and §5.2's whole-split defaults from the auto-round rerun. A figure edited by hand, a record
changed, or a row pointing at the wrong run fails here."""
from __future__ import annotations

import json
import re
import statistics

from amct_ext.algorithms.recipe import parse_algo
from tests.conftest import REPO, load_script

BENCH = REPO / "benchmarks"
GIB = 2 ** 30


def _results() -> str:
    return (BENCH / "RESULTS.md").read_text(encoding="utf-8")


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end, text.index(start))]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _speed_rows() -> list[list[str]]:
    block = _between(_results(), "<!-- layer-speed:begin -->", "<!-- layer-speed:end -->")
    return [_cells(r) for r in block.splitlines()[3:] if r.startswith("| ")]


def _recorded(folder: str, tag: str) -> dict:
    """capture + solve, layer and device peak of run ``tag`` in ``benchmarks/gpu/<folder>``."""
    if "_blockround/" in folder and tag.endswith("warm-median"):   # a default's median over its warm repeats
        speed = load_script("benchmarks/scripts/block_rounding_speed.py")
        rs = {r["tag"]: r for r in speed.rows()}
        if tag == "w4a8-warm-median":
            tags = speed.W4A8_WARM_RUNS
        elif folder.startswith(speed.H200B):          # the default since recompute_units=false
            tags = speed.NOW_WARM_RUNS
        else:
            tags = speed.DEFAULT_WARM_RUNS
        (scheme,) = {rs[t]["scheme"] for t in tags}
        (algo,) = {rs[t]["algo"] for t in tags}
        med = {k: statistics.median(rs[t][k] for t in tags) for k in ("capture_solve_s", "layer_s", "device_gib")}
        return {"capture_solve": med["capture_solve_s"], "layer": med["layer_s"], "device": med["device_gib"],
                "n": len(tags), "algo": algo, "scheme": scheme}
    if "_blockround/" in folder:
        speed = load_script("benchmarks/scripts/block_rounding_speed.py")
        r = speed.load(tag, *folder.split("/", 1))
        return {"capture_solve": r["capture_solve_s"], "layer": r["layer_s"], "device": r["device_gib"],
                "n": 1, "algo": r["algo"], "scheme": r["scheme"]}
    (row,) = [r for r in json.loads((BENCH / "gpu" / folder / "issue24.json").read_text())["rows"] if r["tag"] == tag]
    if row["source"] == "llm-compressor":      # its oneshot is its capture and solve at once
        return {"capture_solve": row["oneshot_s"]["median"], "layer": row["layer_s"]["median"],
                "device": row["device"]["median"] / GIB, "n": row["oneshot_s"]["n"], "algo": row["algo"]}
    return {"capture_solve": row["capture_solve_s"]["median"], "layer": row["layer_s"]["median"],
            "device": row["device"]["median"] / GIB, "n": row["capture_solve_s"]["n"], "algo": row["algo"],
            "scheme": row["scheme"]}


def _ran_algo(label: str) -> str | None:
    """The --algo a run's record names: ``default (`rtn`)``, ``--algo A --propagate P`` in backticks,
    a bare block-rounding algo string; None for llm-compressor."""
    m = re.search(r"`(?:--algo )?([^` ]+)", label)
    if m:
        return m.group(1)
    return label if re.fullmatch(r"[\w:=.,-]+", label) else None


def test_every_speed_row_is_its_run_record():
    rows = _speed_rows()
    assert len(rows) == 16
    for recipe, what, cs, layer, dev, date, run in rows:
        m = re.fullmatch(r"`([^`]+)` (\S+)", run)
        assert m, run
        folder, tag = m.groups()
        assert re.match(rf"h[12]00_{date}", folder), (run, date)        # the date is the run folder's
        rec = _recorded(folder, tag)
        assert (cs, layer, dev) == (f"{rec['capture_solve']:.1f}", f"{rec['layer']:.1f}", f"{rec['device']:.1f}"), run
        if not tag.endswith("warm-median"):            # a warm-median row names its repeats in its run cell
            assert ("median of 3" in recipe) == (rec["n"] == 3), run
        if "default" in what and "scheme" in rec:      # a default's row is that scheme's run
            assert what == f"{rec['scheme']} default", run
        ran = _ran_algo(rec["algo"])
        if recipe.startswith("`"):                     # the recipe is what the run ran, setting by setting
            algo = recipe.split("`")[1].split("@")[0]
            assert ran is not None and parse_algo(algo).settings() == parse_algo(ran).settings(), (run, algo, ran)
        else:
            assert ran is None and recipe.startswith("llm-compressor") and "llm-compressor" in rec["algo"], run


def test_the_w4a16_g128_default_has_one_answer():
    """§2 gives one figure for w4a16-g128's default: the row of today's recipe (block-wise rounding
    since issue 34; the median of its warm repeats), and the prose names the replaced recipe's figure (46.6) and the log's other two
    as other code (60.4) and another recipe (39.5)."""
    from amct_ext.algorithms.recipe import named_recipe

    algo, prop = named_recipe("w4a16-g128", "default")
    (row,) = [r for r in _speed_rows() if r[1] == "w4a16-g128 default"]
    assert row[0] == f"`{algo}@{prop}`" and row[2] == "61.5" and row[6].endswith("warm-median")
    (replaced,) = [r for r in _speed_rows() if r[1] == "w4a16-g128 until 2026-12-06"]
    assert replaced[2] == "46.6"
    old = _recorded("h200_2026-12-02/res", "def-w4a16-g128")
    w4a8 = _recorded("h200_2026-12-02/res", "def-w4a8")
    assert f"{old['capture_solve']:.1f}" == "60.4" and f"{w4a8['capture_solve']:.1f}" == "39.5"
    sec = _between(_results(), "## 2. Speed per layer", "## 3. ")
    assert "**w4a16-g128's default has one answer: 61.5 s**" in sec
    assert sec.count("46.6") == 2 and sec.count("60.4") == 1 and sec.count("39.5") == 1


def test_v4_pro_and_export_figures_are_their_records():
    text = _results()
    for name, quoted in (("pro_rtn", "30.0 s"), ("pro_gptq_sequential_false", "214.1 s")):
        rec = json.loads((BENCH / "gpu" / "h200_2026-12-01" / f"{name}.json").read_text())
        (layer,) = rec["ptq"]["per_layer"].values()
        assert f"{layer['seconds']:.1f} s" == quoted and quoted in text, name
    ratios = {fmt: sorted(json.loads(p.read_text())["time_over_floor"] for p in (BENCH / "gpu").glob(f"export_{fmt}_w8a8_h200*.json"))
              for fmt in ("ct", "ascend")}
    assert len(ratios["ct"]) == 3 and len(ratios["ascend"]) == 2
    sec = _between(text, "## 7. Export", "## 8. ")
    ct, asc = ratios["ct"], ratios["ascend"]
    assert f"**{statistics.median(ct):.2f}x** for compressed-tensors (median of 3,\n  {ct[0]:.2f}-{ct[-1]:.2f}x)" in sec
    assert f"**{statistics.median(asc):.2f}x** for Ascend (median of 2, {asc[0]:.2f}-{asc[-1]:.2f}x)" in sec


def test_section_5_2_is_the_whole_split_record():
    fs = json.loads((BENCH / "quality" / "peer_autoround_rerun.json").read_text())["full_split"]
    sec = _between(_results(), "### 5.2 ", "### 5.3 ")
    rows = [_cells(r) for r in sec.splitlines() if re.match(r"^\| w\d", r)]
    assert [r[0] for r in rows] == ["w4a16-g128", "w3a16-g128", "w4a16"]
    for s, recipe, peer, ours in rows:
        a, o = fs["peer"][s]["ppl"], fs["ours"][f"{s}|default"]["ppl"]
        assert peer == f"{a:.4f}" and ours == f"{o:.4f} ({100 * (o / a - 1):+.2f} %)", s
        # the recorded run is that recipe (its algorithms, in order)
        names = [x.name for x in parse_algo(recipe.strip("`").split("@")[0]).algorithms]
        assert fs["ours"][f"{s}|default"]["recipe"] == names, s
        assert o > a, s                                    # "trade these gaps": behind auto-round
