"""The hash-routing tables checked by the plan (issue 36.3).

A hash layer routes token ``t`` to the experts ``tid2eid[t]``; an id outside
``[0, n_routed_experts)`` used to surface as torch's "index 99 is out of bounds for dimension 1"
traceback in the first layer's forward (casebook i36t-10). The tables are small (V4-Flash:
129,280 x 6 int64 = 6.2 MB a hash layer, three layers), so the plan reads them -- the only tensor
data it reads -- and names the layer, the token and the id.
"""
from __future__ import annotations

from pathlib import Path

from amct_ext.errors import CheckpointError

TABLE = "ffn.gate.tid2eid"


def check_hash_routing(model_path: Path, config) -> None:
    """Every hash layer's ``tid2eid`` in ``[0, n_routed_experts)`` with one row per vocabulary id.
    A missing key or shard is left to the index check, which names it."""
    from amct_ext.io.checkpoint import CheckpointReader

    n_experts = int(config.n_routed_experts)
    reader = CheckpointReader(model_path)
    try:
        for i in range(int(config.n_hash_layers)):
            key = f"layers.{i}.{TABLE}"
            if not reader.has(key) or not (reader.root / reader.shard_of(key)).is_file():
                continue
            try:
                table = reader.get_raw(key)
            except Exception:   # an unreadable shard: the checkpoint checks name it
                continue
            if table.is_floating_point() or table.dim() != 2:
                # a table of the wrong dtype or rank: the plan's shard-header check (after the config)
                # names it against the model's expectation; only the values are this check's concern
                continue
            bad = (table < 0) | (table >= n_experts)
            if bool(bad.any()):
                tok, col = (int(v) for v in bad.nonzero()[0])
                raise CheckpointError(f"{reader.root / reader.shard_of(key)}: {key}[{tok}, {col}] = {int(table[tok, col])} is not an "
                                      f"expert id (n_routed_experts={n_experts}: ids 0..{n_experts - 1}); "
                                      f"{int(bad.sum())} entries are out of range")
    finally:
        reader.close()


__all__ = ["check_hash_routing"]
