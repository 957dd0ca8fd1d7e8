"""Command-line pieces shared by tools/run_ptq.py and tools/export.py: the built-in model names,
where their checkpoints come from, and the model / device arguments both tools take.

Kept here (a library module) so that neither tool imports the other (issue 25.4): run_ptq
calls the export through ``amct_ext.export.job``, not through export's parser.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from amct_ext.data import CALIB_DEFAULT
from amct_ext.errors import CheckpointError, ConfigError

REPO = Path(__file__).resolve().parents[2]
MODELS = ("tiny", "tiny-serve", "tiny-trained", "tiny-trained-release", "v4-flash", "v4-pro")
TINY_MODELS = ("tiny", "tiny-serve", "tiny-trained", "tiny-trained-release")
TRAINED_TINY = REPO / "assets" / "tiny-v4"   # trained on the Wikitext-2 validation split (tools/train_tiny.py)
# the same tiny trained on the release's grids and stored like the release: FP8 e4m3 128x128 blocks
# (attention, shared expert), FP4 e2m1 per 32 (routed experts), ue8m0 scales (tools/train_release_tiny.py)
TRAINED_RELEASE_TINY = REPO / "assets" / "tiny-v4-release"
SHIPPED_TINIES = {"tiny-trained": TRAINED_TINY, "tiny-trained-release": TRAINED_RELEASE_TINY}
MODELSCOPE_IDS = {"v4-flash": "deepseek-ai/DeepSeek-V4-Flash", "v4-pro": "deepseek-ai/DeepSeek-V4-Pro"}


def cache_root() -> Path:
    return Path(os.environ.get("AMCT_CACHE") or Path.home() / ".cache" / "amct_ext")


def tiny_checkpoint(text_path: Path | None = None, model: str = "tiny") -> Path:
    """The cached random tiny checkpoint; generated atomically (temp folder, then rename).
    Its tokenizer is trained on ``text_path`` (default: the shipped validation split); the folder
    name carries a hash of the config, generator version and that text, so a changed generator
    or text never reuses a stale checkpoint."""
    from .tiny import make_tiny_checkpoint, tiny_cache_key
    from .tiny_serve import TINY_SERVE_OVERRIDES

    # tiny-serve: the same generator at the geometry vLLM's kernels accept (tiny_serve.py)
    overrides = TINY_SERVE_OVERRIDES if model == "tiny-serve" else {}
    stem = "tiny-serve" if model == "tiny-serve" else "tiny-v4"
    text_path = Path(text_path) if text_path is not None else CALIB_DEFAULT
    target = cache_root() / f"{stem}-{tiny_cache_key(text_path, **overrides)}"
    if (target / "config.json").is_file() and (target / "model.safetensors.index.json").is_file():
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stem}.", dir=target.parent))
    try:
        make_tiny_checkpoint(tmp, fmt="bf16", seed=0, text_path=text_path, **overrides)
        if target.exists():          # an incomplete earlier attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def download_checkpoint(model: str, dest: Path | None) -> Path:
    try:
        from modelscope import snapshot_download  # imported lazily: optional dependency
    except ImportError:
        raise CheckpointError(f"--download needs modelscope (pip install modelscope), which is not installed; "
                              f"or download {MODELSCOPE_IDS[model]} yourself and pass --model-path DIR") from None
    dest = dest or cache_root() / model
    try:
        return Path(snapshot_download(MODELSCOPE_IDS[model], local_dir=str(dest)))
    except Exception as e:  # offline, auth, disk: one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"downloading {MODELSCOPE_IDS[model]} with modelscope failed ({first}); "
                              f"are you offline? download it elsewhere and pass --model-path DIR") from None


def resolve_model_path(args, calib_path: Path | None = None) -> Path:
    """The checkpoint folder of ``args.model`` / ``args.model_path`` / ``args.download``."""
    if args.model in TINY_MODELS:
        if args.model_path:
            path = Path(args.model_path)
            if not path.is_dir():
                raise CheckpointError(f"--model-path {path} does not exist or is not a folder "
                                      f"(omit --model-path to use the built-in {args.model} checkpoint)")
            return path
        if args.model in SHIPPED_TINIES:
            return SHIPPED_TINIES[args.model]
        return tiny_checkpoint(calib_path, args.model)
    if getattr(args, "download", False):
        return download_checkpoint(args.model, Path(args.model_path) if args.model_path else None)
    if not args.model_path:
        raise ConfigError(f"--model {args.model} needs --model-path DIR (the checkpoint folder) or --download")
    path = Path(args.model_path)
    if not path.is_dir():
        raise CheckpointError(f"--model-path {path} does not exist or is not a folder")
    return path


def check_weights_present(path: Path, model: str = "v4-flash") -> None:
    has_index = (path / "model.safetensors.index.json").is_file() or \
        (path / "quant_model_weights.safetensors.index.json").is_file()  # an Ascend export
    has_single = (path / "model.safetensors").is_file()
    if not (has_index or has_single):
        hint = ("download the checkpoint there or use --download" if model in MODELSCOPE_IDS
                else f"omit --model-path to use the built-in {model} checkpoint")
        raise CheckpointError(f"{path}: no weights (neither model.safetensors.index.json nor model.safetensors); "
                              + hint)


def add_model_arguments(group: argparse._ActionsContainer) -> None:
    """--model / --model-path / --download, the same in both tools."""
    group.add_argument("--model", choices=MODELS, default="tiny",
                       help="built-in model: " + ", ".join(MODELS) + " (default tiny)")
    group.add_argument("--model-path", default=None, help="checkpoint folder (config.json, shards, tokenizer)")
    group.add_argument("--download", action="store_true", help="fetch v4-flash / v4-pro with modelscope")


class PlainHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, option help wrapped."""
