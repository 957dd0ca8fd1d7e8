"""What every peer benchmark script shares (peer_llmcompressor.py, peer_autoround.py, peer_msmodelslim.py).

- the peer's own virtual environment: create / reuse it (torch's CPU wheel first), re-run the
  script inside it, and the offline / thread environment its processes get;
- the command line every peer takes: the protocol flags (data, windows, seed) and the defaults
  of the data paths, and the parse-time checks of --model, the texts, the counts, --json and
  --venv, with the caller's way of refusing bad input (before any model load or venv install);
- the protocol itself: the project's evaluation / calibration windows and their digests, and the
  windows the project's workflow builds (what ``--smoke`` compares them with);
- the records: versions, machine, command, date, the result JSON (resumed and written atomically).

Stdlib only at import: the peer venvs import the peer scripts (and so this module) before, or
without, the project's own dependencies; whatever needs torch or amct_ext imports it inside.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Where helper i17 ships the test split inside the package (amct_ext/data/...).
SHIPPED_EVAL = REPO / "amct_ext" / "data" / "wikitext-2-raw" / "wiki.test.raw"
NO_EVAL_DATA = ("no shipped copy of the Wikitext-2 test split in amct_ext/data; "
                "pass --eval-data PATH/wiki.test.raw")


def fail(msg: str):
    """A bad input: one `error: ...` line on stderr and exit status 2 (the project's CLI rule)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# =========================================================================== command line
def add_protocol_args(ap, *, eval_windows: int | None = 64, eval_windows_help: str | None = None) -> None:
    """The protocol flags: test / calibration text, window length and counts, the calibration seed."""
    ap.add_argument("--eval-data", type=Path, default=None,
                    help="raw Wikitext-2 test split (default: the copy shipped in amct_ext/data)")
    ap.add_argument("--calib-data", type=Path, default=None,
                    help="calibration text (default: amct_ext.pipeline.calibration's default)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=eval_windows, help=eval_windows_help)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="the calibration windows' draw (the project's seed)")


def add_rerun_args(ap) -> None:
    """The flags of a result JSON that keeps finished cells, and of the float check before them."""
    ap.add_argument("--redo", action="store_true", help="recompute cells already in the JSON")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing JSON")
    ap.add_argument("--allow-float-mismatch", action="store_true")


def resolve_data_paths(args, error, *, also=()) -> None:
    """Fill ``args.eval_data`` / ``args.calib_data`` with the project's defaults; ``error(msg)`` (the
    caller's: ``ap.error`` or :func:`fail`) when there is no test split, or when one of the two texts
    or of the paths in ``also`` is no file. Every mode of every peer reads both texts (none creates
    them), so a wrong path is refused here, before a venv install or a model load."""
    if args.eval_data is None:
        args.eval_data = default_eval_path()
        if args.eval_data is None:
            error(NO_EVAL_DATA)
    if args.calib_data is None:
        args.calib_data = default_calib_path()
    for p in (args.eval_data, args.calib_data, *also):
        p = Path(p)
        if p.is_dir():
            error(f"{p}: a folder, not a file")
        if not p.is_file():
            error(f"{p}: no such file")


def check_numbers(args, error, *, at_least_one=("calib_samples", "threads")) -> None:
    """The protocol's counts, refused before any work: ``--seq-len`` >= 2 (a window predicts at least
    one token), ``--eval-windows`` >= 1 (None: the whole split, where the script allows it) and the
    ``at_least_one`` flags >= 1. Past this point the project's loaders would raise a DataError
    traceback, after the tokenizer load (and in the peer's venv, after its install)."""
    if args.seq_len < 2:
        error(f"--seq-len {args.seq_len}: must be >= 2 (a window predicts at least one token)")
    if args.eval_windows is not None and args.eval_windows < 1:
        error(f"--eval-windows {args.eval_windows}: must be >= 1")
    for name in at_least_one:
        value = getattr(args, name)
        if value < 1:
            error(f"--{name.replace('_', '-')} {value}: must be >= 1")


def read_json_object(path, error, what: str) -> dict:
    """``path``'s JSON object, or ``error(msg)`` naming ``what`` (the flag) and the file when it is
    missing, a folder, unreadable, not JSON, or JSON but not an object."""
    path = Path(path)
    if path.is_dir():
        error(f"{what} {path}: a folder, not a JSON file")
    if not path.is_file():
        error(f"{what} {path}: no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        error(f"{what} {path}: not readable JSON ({e})")
    if not isinstance(obj, dict):
        error(f"{what} {path}: a JSON {type(obj).__name__}, not an object")
    return obj


def check_model_dir(model, error) -> None:
    """``--model`` is a folder whose ``config.json`` is a JSON object: what every peer's first load
    reads (transformers' AutoConfig / AutoTokenizer, msModelSlim's config reader). A missing folder
    is otherwise taken for a hub repo id and, like a bad config.json, ends in an OSError traceback."""
    model = Path(model)
    if not model.exists():
        error(f"--model {model}: no such folder")
    if not model.is_dir():
        error(f"--model {model}: not a folder (pass the checkpoint folder that holds config.json)")
    read_json_object(model / "config.json", error, "--model")


def check_result_json(path, error, *, read: bool) -> None:
    """``--json``: never a folder (the result is written there at the end, after all the work);
    when ``read`` (a run that resumes or merges into it) an existing file must be a JSON object."""
    path = Path(path)
    if path.is_dir():
        error(f"--json {path}: a folder, not a JSON file")
    if read and path.exists():
        read_json_object(path, error, "--json")


def check_venv_dir(venv, error) -> None:
    """``--venv`` is a virtual environment (``pyvenv.cfg``), an empty folder or a path not there yet:
    the script creates a venv in it and pip-installs the peer into it. A file fails in ``venv``'s
    own traceback; a non-empty folder that is no venv (a prefix such as /usr, a source tree)
    would get a venv written over its contents, or the peer installed into that python."""
    venv = Path(venv)
    if not venv.exists():
        return
    if not venv.is_dir():
        error(f"--venv {venv}: not a folder (pass a virtual environment or a new folder)")
    try:
        empty = not any(venv.iterdir())
    except OSError as e:
        error(f"--venv {venv}: cannot list it ({e.strerror})")
    if not (venv / "pyvenv.cfg").is_file() and not empty:
        error(f"--venv {venv}: not a virtual environment (no pyvenv.cfg) and not empty; "
              "pass a venv or a new folder")


# =========================================================================== protocol
def default_eval_path() -> Path | None:
    """The shipped test split when the package has it (helper i17), else None."""
    try:
        from amct_ext.data import EVAL_DEFAULT  # type: ignore[attr-defined]
        if Path(EVAL_DEFAULT).is_file():
            return Path(EVAL_DEFAULT)
    except Exception:  # noqa: BLE001  (older tree without amct_ext.data)
        pass
    return SHIPPED_EVAL if SHIPPED_EVAL.is_file() else None


def default_calib_path() -> Path:
    """The project's own default calibration text (whatever amct_ext.pipeline.calibration points to)."""
    from amct_ext.pipeline import calibration

    return Path(calibration.DEFAULT_CALIBRATION_PATH)


def digest(t) -> str:
    """sha256 of a token-window tensor (shape + int64 values): equal digests = equal windows."""
    import torch

    t = t.to(torch.int64).contiguous()
    h = hashlib.sha256(repr(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def protocol_windows(tokenizer, eval_path: Path, calib_path: Path, seq_len: int,
                     eval_windows: int, calib_samples: int, seed: int):
    """(eval windows, calibration windows), exactly as the project's workflow builds them."""
    from amct_ext.pipeline.calibration import load_calibration_windows
    from amct_ext.pipeline.perplexity import load_eval_text, tokenize_windows

    ev = tokenize_windows(load_eval_text(eval_path), tokenizer, seq_len, eval_windows)
    cal = load_calibration_windows(calib_path, tokenizer, seq_len, calib_samples, seed)
    return ev, cal


def load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def workflow_windows(args, dev: bool = False):
    """(eval, calibration, dev or None) windows of ``args``' protocol as the project's workflow
    builds them through the V4 adapter: what ``--smoke`` holds :func:`protocol_windows` against.
    The dev windows are the ``eval_windows`` that follow the reported ones."""
    import torch
    from amct_ext.base import EvalConfig, PtqConfig, RunConfig
    from amct_ext.pipeline.workflow import load_calib_windows, load_eval_windows
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    adapter = DeepseekV4Adapter(RunConfig(model_path=args.model, device="cpu",
                                          dtype=torch.float32, progress=False))
    ev = load_eval_windows(adapter, EvalConfig(seq_len=args.seq_len, max_windows=args.eval_windows,
                                               data_path=args.eval_data))
    cal = load_calib_windows(adapter, PtqConfig(seq_len=args.seq_len, n_samples=args.calib_samples,
                                                seed=args.seed, calib_path=args.calib_data))
    dv = (load_eval_windows(adapter, EvalConfig(seq_len=args.seq_len, max_windows=args.eval_windows,
                                                data_path=args.eval_data, first_window=args.eval_windows))
          if dev else None)
    return ev, cal, dv


def smoke_report(json_path, protocol: dict, checks: dict) -> int:
    """Print ``checks`` and the verdict (every boolean check true), write them with the protocol
    record to ``json_path`` when given; the smoke run's exit status."""
    if json_path:
        save(Path(json_path), {"smoke": True, "protocol": protocol, "checks": checks})
    ok = all(v for v in checks.values() if isinstance(v, bool))
    print(json.dumps(checks))
    print("smoke ok" if ok else "smoke FAILED")
    return 0 if ok else 1


# =========================================================================== records
def versions(packages) -> dict:
    """Python and the installed versions of ``packages`` (None: not installed); every peer's record."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def machine() -> dict:
    return {"description": f"{os.cpu_count()}-core CPU box (shared), {platform.machine()}",
            "platform": platform.platform(), "cpu_count": os.cpu_count()}


def utc_date() -> str:
    """The records' ``date`` (minutes, UTC)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line(script, argv) -> str:
    """The records' ``command``: the script's file name and its arguments."""
    return " ".join([Path(script).name] + list(argv))


def rel_to_repo(p) -> str:
    """``p`` relative to the repository when it lies inside (resolved), else as given."""
    r = Path(p).resolve()
    return str(r.relative_to(REPO)) if r.is_relative_to(REPO) else str(p)


def load_results(path: Path, fresh: bool = False) -> dict:
    """The result JSON so far (its finished cells are kept), or a new one (none yet, or ``fresh``);
    always with ``cells``."""
    path = Path(path)
    res = json.loads(path.read_text()) if path.is_file() and not fresh else {}
    res.setdefault("cells", {})
    return res


def save(path: Path, res: dict) -> None:
    from amct_ext.io.io_utils import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(res, path)


# =========================================================================== the peer's venv
def with_pythonpath(env: dict, first: str) -> dict:
    """``env`` with ``first`` put before whatever PYTHONPATH it has."""
    env["PYTHONPATH"] = first + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def peer_env(threads: int, *, keep_set: bool) -> dict:
    """This process's environment for a peer process: offline (no hub access) and ``threads``
    OpenMP threads. ``keep_set``: values the caller's environment already has win (a re-run of
    the whole script); else these win (one step that must run as recorded)."""
    pinned = {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {**pinned, **os.environ} if keep_set else {**os.environ, **pinned}


def ensure_peer_venv(venv: Path, quiet: bool = False, *, module: str, dist: str, version_prefix: str,
                     requirements) -> Path:
    """Create / reuse ``venv`` with torch (local CPU wheel) then the peer (``requirements``, whose
    ``dist`` must import as ``module`` at ``version_prefix``); its python."""
    py = venv / "bin" / "python"
    if not py.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Only the LAST stdout line counts: importing llmcompressor logs a "No accelerator
    # available!" warning to stdout on a CPU box (casebook/peer-llm-compressor.md P11).
    probe = subprocess.run([str(py), "-c", f"import {module}, transformers, torch; "
                            f"import importlib.metadata as m; print(m.version({dist!r}))"],
                           capture_output=True, text=True)
    lines = probe.stdout.strip().splitlines()
    if probe.returncode != 0 or not lines or not lines[-1].startswith(version_prefix):
        pip = [str(py), "-m", "pip", "install"] + (["-q"] if quiet else [])
        # torch first: pinning it before the peer resolves keeps pip on the CPU wheel.
        subprocess.run(pip + [requirements[0]], check=True)
        subprocess.run(pip + list(requirements), check=True)
    return py


def peer_or_rerun(peer_main, args, argv: list, *, script: str, inside_env: str, ensure_venv,
                  pythonpath: str | None = None) -> int:
    """``peer_main(args)`` when this process is the re-run inside the peer's venv (``inside_env=1``);
    else create / reuse that venv (``ensure_venv(args.venv)``, its python) and re-run ``script argv``
    there (:func:`rerun_in_peer_venv`); the exit code."""
    if os.environ.get(inside_env) == "1":
        return peer_main(args)
    return rerun_in_peer_venv(ensure_venv(args.venv), script, argv, inside_env, args.threads, pythonpath)


def rerun_in_peer_venv(py: Path, script: str, argv: list, inside_env: str, threads: int,
                       pythonpath: str | None = None) -> int:
    """Run ``script argv`` again with the peer venv's python ``py``, marked by ``inside_env=1``,
    offline, ``threads`` OpenMP threads (and ``pythonpath`` first on PYTHONPATH); its exit code."""
    env = peer_env(threads, keep_set=True)
    env[inside_env] = "1"
    if pythonpath:
        with_pythonpath(env, pythonpath)
    return subprocess.run([str(py), str(Path(script).resolve())] + list(argv), env=env).returncode
