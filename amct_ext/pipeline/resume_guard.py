"""Which units of a layer a (resumed) PTQ run must solve: the one place ``run_blockwise_ptq`` asks.

A unit an earlier run finished is taken only when (``run_folder.RunFolder``):
- its ``.pt`` is a whole archive (a truncated or damaged one is solved again, with one line);
- its layer's weights record matches the checkpoint now: the digest chain over the stem and
  every layer up to this one (``io/weights_digest.py``). A fine-tune of the same layout, or
  weights changed in place, is found at the first changed layer, named with its first changed
  tensor, and that layer and every later one are solved again.

The digests are computed in a background thread started with the run (``WeightsDigest``), one
layer ahead of the loop, so the hashing overlaps the layers' work.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Sequence

from ..io.weights_digest import WeightsDigest, weight_groups
from .run_folder import RunFolder, warn


def layer_key_prefix(adapter: Any, layer: int) -> str:
    """The checkpoint key prefix of a layer id: the adapter's declared ``layer_name`` (the model
    names its extra layers, e.g. V4's MTP layer ``mtp.{j}``) and a dot."""
    return f"{adapter.layer_name(layer)}."


class ResumeGuard:
    """The unit files and weights records of one ``run_blockwise_ptq`` call (see the module doc).
    ``layers``: every layer id the run builds, in order (MTP last); the chain starts at layer 0."""

    def __init__(self, adapter: Any, output_dir: str | Path, layers: Sequence[int]):
        self.folder = RunFolder(output_dir)
        reader = adapter.reader
        self.digest: WeightsDigest | None = None
        if reader is not None and getattr(reader, "weight_map", None):
            main = [i for i in range(0, max([i for i in layers if i < adapter.num_layers], default=-1) + 1)]
            ids = main + [i for i in layers if i >= adapter.num_layers]
            extra = (f"{adapter.extra_layers}.",) if adapter.extra_layers else ()
            groups = weight_groups(reader.weight_map, [(f"layer {i}", layer_key_prefix(adapter, i)) for i in ids],
                                   extra)
            self.digest = WeightsDigest(reader.root, reader.weight_map, groups).start()
            # a run that ends in an exception never calls close(): the thread stops with the guard
            weakref.finalize(self, self.digest.close)

    def todo(self, layer: int, units: Sequence[Any]) -> set[str]:
        """Names of ``units`` (layer ``layer``'s) to solve; records the layer's weights digest
        before any of them is written."""
        todo = {u.name for u in units if not self.folder.unit_done(u.file_stem)}
        if self.digest is None:
            return todo
        d = self.digest.get(f"layer {layer}")
        why = self.folder.layer_weights_change(layer, d, has_done_units=len(todo) < len(units))
        if why is not None:
            warn(why)
            todo = {u.name for u in units}
        if todo:
            self.folder.write_layer_weights(layer, d)
        return todo

    def close(self) -> None:
        if self.digest is not None:
            self.digest.close()


__all__ = ["ResumeGuard", "layer_key_prefix"]
