"""Checks of the job plan that read files but no tensor data (issue 36): the checkpoint's links,
every shard's header against the model skeleton, and a config that covers fewer layers than the
checkpoint holds. Each refusal is one line naming the file, key or field; the plan
(``job.build_job``) and the model's plan spec call them before any work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError, ConfigError
from ..io import shard_headers
from ..io.links import check_folder_links

#: the flag that accepts a config.json covering fewer layers than the checkpoint
FEWER_LAYERS_FLAG = "--allow-fewer-layers"


def check_checkpoint_links(model_path: Path) -> None:
    """No top-level file of the checkpoint folder is a link that leaves it (the hub cache's
    ``snapshots/REV -> ../../blobs`` links are inside; ``io/links.py``)."""
    p = Path(model_path)
    if p.is_dir():
        check_folder_links(p)


def check_checkpoint_headers(reader: Any, expected: Mapping[str, tuple], where: str) -> int:
    """Every shard's header read and checked (``io/shard_headers.py``): file sizes, keys in the
    shards the index names, every expected tensor's stored dtype, scale and shape. Returns the
    number of tensors checked against the skeleton."""
    shards = sorted(set(reader.weight_map.values()))
    headers = shard_headers.read_headers(reader.root, shards)
    shard_headers.check_index_against_headers(headers, reader.weight_map, where)
    return shard_headers.check_expected(headers, reader.weight_map, expected, where)


def check_layer_count(config_layers: int, checkpoint_layers: int, where: str, allow_fewer: bool,
                      field: str = "num_hidden_layers") -> None:
    """A config.json that covers fewer decoder layers than the checkpoint holds would quantize a
    shorter model and report it as the whole one: refused unless the user says so."""
    if checkpoint_layers > config_layers and not allow_fewer:
        raise ConfigError(f"{where}: config.json {field}={config_layers} but the checkpoint holds "
                          f"{checkpoint_layers} layers (0..{checkpoint_layers - 1}); a run would quantize and "
                          f"evaluate only the first {config_layers}. Fix {field}, or pass {FEWER_LAYERS_FLAG} "
                          "to run that shorter model on purpose")
    if checkpoint_layers < config_layers:   # check_checkpoint names the first missing key
        raise CheckpointError(f"{where}: config.json {field}={config_layers} but the checkpoint holds "
                              f"{checkpoint_layers} layers")


__all__ = ["check_checkpoint_links", "check_checkpoint_headers", "check_layer_count", "FEWER_LAYERS_FLAG"]
