"""DeepSeek-V4's built-in model names: where their checkpoints come from, the job's defaults for
each (``MODEL_DEFAULTS``), and the model / device arguments tools/run_ptq.py and tools/export.py
both take. The library entry point (``amct_ext.pipeline.options.plan_job``) reaches the names and
defaults through ``V4Binding`` (binding.py: ``model_names``, ``model_defaults``,
``resolve_checkpoint``); the tools import this module directly.

Kept here (a library module) so that neither tool imports the other (issue 25.4): run_ptq
calls the export through ``amct_ext.export.job``, not through export's parser.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from amct_ext.data import CALIB_DEFAULT, cache_root  # noqa: F401  (cache_root: the tools' import)
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


# the job's defaults per built-in model for options left unset (None): the tiny ones are chosen
# so that the whole run, PPL included, takes well under two minutes on 2 CPU cores; "v4" is
# every other name (and a checkpoint given by folder only)
_TINY = dict(calib_samples=8, seq_len=128, eval_windows=32, eval_ppl=True, dtype="fp32", threads=1,
             batch_size=1, eval_batch_size=8)
_TRAINED = dict(_TINY, calib_samples=16, seq_len=256, eval_windows=64)
MODEL_DEFAULTS = {
    "tiny": _TINY,
    "tiny-serve": _TINY,
    "tiny-trained": _TRAINED,
    "tiny-trained-release": _TRAINED,
    "v4": dict(calib_samples=128, seq_len=2048, eval_windows=None, eval_ppl=False, dtype="bf16", threads=None,
               batch_size=1, eval_batch_size=1, capture_memory_gb=8.0),
}


def model_defaults(name: str | None) -> dict:
    """The job options model ``name`` takes where the caller left them unset."""
    return dict(MODEL_DEFAULTS[name if name in MODEL_DEFAULTS else "v4"])


def resolve_checkpoint(model: str | None, model_path=None, download: bool = False,
                       calib_path: Path | None = None) -> Path:
    """The checkpoint folder of built-in ``model`` (``model_path`` / ``download`` as the flags
    --model-path / --download); ``calib_path``: the text a generated tiny's tokenizer is trained on."""
    if model in TINY_MODELS:
        if model_path:
            path = Path(model_path)
            if not path.is_dir():
                raise CheckpointError(f"--model-path {path} does not exist or is not a folder "
                                      f"(omit --model-path to use the built-in {model} checkpoint)")
            return path
        if model in SHIPPED_TINIES:
            return SHIPPED_TINIES[model]
        return tiny_checkpoint(calib_path, model)
    if download and model in MODELSCOPE_IDS:
        return download_checkpoint(model, Path(model_path) if model_path else None)
    if not model_path:
        raise ConfigError(f"--model {model} needs --model-path DIR (the checkpoint folder) or --download")
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointError(f"--model-path {path} does not exist or is not a folder")
    return path


def check_weights_present(path: Path, model: str | None = "v4-flash") -> None:
    has_index = (path / "model.safetensors.index.json").is_file() or \
        (path / "quant_model_weights.safetensors.index.json").is_file()  # an Ascend export
    has_single = (path / "model.safetensors").is_file()
    if not (has_index or has_single):
        hint = ("download the checkpoint there or use --download" if model in MODELSCOPE_IDS
                else "pass the checkpoint's folder" if model not in TINY_MODELS
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
