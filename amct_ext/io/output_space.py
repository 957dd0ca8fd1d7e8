"""Room for the output, checked before any work (issue 36.3): can the output folder be written
at all, and does its disk have the free space for what the job will write?

Both questions used to be answered by the first write: a read-only folder after the float and
RTN perplexities, a full disk in the middle of a layer (casebook i36t-1, i36t-3). Here the plan
asks them first:

- :func:`probe_writable` creates and removes one probe file in the folder (or, when it does not
  exist yet, in the nearest existing folder above it, where the run will create it): the only
  test of "writable" that holds for read-only mounts, ACLs, immutable folders and root alike.
- :func:`check_free_space` compares ``shutil.disk_usage`` of that folder with an estimate
  (:func:`ptq_params_bytes`, :func:`export_bytes`) less what the folder already holds (a
  resumed run wrote part of it).

The estimates are what the files hold, not a bound on every byte: a unit whose algorithm
replaces its weight (GPTQ, rounding) stores one code per weight (half a byte packed at <= 4
bits), smoothing stores a float weight, the clip-only recipes store a few factors per row;
captured calls that spill (``--capture-memory-gb``) are not counted. A write that still fails
is one line too (``atomic_write``, the tools' error boundary).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

from ..errors import OutputError, os_error_line

PROBE_PREFIX = ".amct-write-probe-"
#: report.json, meta.json, layers.json, the error plot: a fixed allowance
SMALL_FILES_BYTES = 1 << 20
#: a unit's .json and the small state of its .pt (clip factors, smoothing scales): an allowance per unit
UNIT_FILES_BYTES = 8 << 10
#: algorithms whose unit files hold a replaced weight, and how it is stored
CODES = "codes"        # the on-grid weight as codes (QuantLinear: one byte, or packed at <= 4 bits)
FLOAT = "float"        # a smoothed weight in the compute dtype
REPLACES_WEIGHT = {"gptq": CODES, "autoround": CODES, "blockround": CODES, "smoothquant": FLOAT, "awq": FLOAT}


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` itself, or the closest folder above it that exists (where it will be created)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def probe_writable(folder: str | os.PathLike, flag: str) -> None:
    """Create and remove a probe file in ``folder`` (or the nearest existing folder above it);
    an OS refusal becomes one :class:`OutputError` naming ``flag``, the folder and the cause."""
    target = nearest_existing(folder)
    try:
        fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=target)
    except OSError as e:
        where = "" if target == Path(folder).absolute() else f" (it would be created in {target})"
        raise OutputError(f"{flag} {folder}: cannot write into it{where}: {os_error_line(e, target)}") from None
    os.close(fd)
    os.unlink(name)


def bytes_under(folder: str | os.PathLike) -> int:
    """Bytes of the regular files already under ``folder`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def check_free_space(folder: str | os.PathLike, need_bytes: int, flag: str, what: str) -> None:
    """Refuse (one line naming ``flag`` and both sizes) when the disk holding ``folder`` has less
    free space than ``need_bytes`` (the estimate of ``what``)."""
    free = shutil.disk_usage(nearest_existing(folder)).free
    if need_bytes > free:
        raise OutputError(f"{flag} {folder}: {_gib(free)} free on its disk, but {what} will write about "
                          f"{_gib(need_bytes)}; free some space or choose a folder on a larger disk")


def code_bytes(numel_by_bits: Mapping[int, int]) -> int:
    """Bytes of the weights' codes: one byte per weight, half a byte when packed (<= 4 bits)."""
    return sum(n // 2 if bits <= 4 else n for bits, n in numel_by_bits.items())


def ptq_params_bytes(numel_by_bits: Mapping[int, int], algorithms: Iterable[str], dtype_bytes: int,
                     n_units: int = 0) -> int:
    """Estimate of OUTPUT/ptq_params for the quantized weights ``numel_by_bits`` ({bits: elements})
    under a recipe of ``algorithms`` (names): the largest form any of them stores a weight in."""
    kinds = {REPLACES_WEIGHT.get(a) for a in algorithms}
    numel = sum(numel_by_bits.values())
    if FLOAT in kinds:
        weights = numel * dtype_bytes
    elif CODES in kinds:
        weights = code_bytes(numel_by_bits)
    else:                       # clip factors / rounding state: a few bytes per row, within the allowance
        weights = 0
    return weights + n_units * UNIT_FILES_BYTES + SMALL_FILES_BYTES


def export_bytes(checkpoint_bytes: int, dequantize_rest: bool) -> int:
    """Estimate of an export: the release's bytes (what is not quantized is copied as released,
    and a weight quantized to <= 8 bits from bf16 / FP8 does not grow), doubled when the rest is
    stored in bf16 (``--dequantize-rest``, the ascend format: FP8 -> bf16). Not counted: FP4
    experts quantized to 8 bits, which grow."""
    return checkpoint_bytes * (2 if dequantize_rest else 1) + SMALL_FILES_BYTES


def checkpoint_bytes(model_path: str | os.PathLike) -> int:
    """Bytes of the checkpoint's weight files (``*.safetensors`` in its folder)."""
    return sum(p.stat().st_size for p in Path(model_path).glob("*.safetensors") if p.is_file())


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


__all__ = ["check_output_room", "probe_writable", "check_free_space", "ptq_params_bytes", "export_bytes", "checkpoint_bytes",
           "bytes_under", "nearest_existing", "code_bytes"]


def check_output_room(folder: str | os.PathLike, flag: str, need_bytes: int, what: str,
                      already: Iterable[str | os.PathLike] = (), probe: bool = True) -> None:
    """The plan's one call: ``folder`` writable (probe; ``probe=False`` where the caller probed
    it already), and its disk's free space at least ``need_bytes`` less what the folders
    ``already`` hold (a resumed run or export wrote part)."""
    if probe:
        probe_writable(folder, flag)
    done = sum(bytes_under(p) for p in already)
    check_free_space(folder, max(0, need_bytes - done), flag, what)
