"""The grouped-GEMM expert path computes exactly what the per-expert reference loop computes."""
import copy

import pytest
import torch

from amct_ext.schemes import load_scheme
from models.deepseek_v4.quant_module import quantize_block, set_quant_enabled
from models.deepseek_v4.tiny import random_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_loop(dtype):
    model = random_tiny_model(0, dtype=dtype)
    ids = torch.randint(2, 512, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loop = model(ids)
        for block in model.layers:
            block.ffn.pack_experts()
            assert block.ffn._packed is not None
        grouped = model(ids)
    assert torch.equal(loop, grouped)


def test_packing_follows_wrappers_and_moves():
    model = random_tiny_model(0, dtype=torch.bfloat16)
    block = model.layers[2]
    block.ffn.pack_experts()
    x = torch.randn(1, 20, 64, dtype=torch.bfloat16)
    assert block.ffn._can_group(x.view(-1, 64))
    q = quantize_block(copy.deepcopy(block), load_scheme("w8a8"), ["moe"])
    q.ffn.pack_experts()
    assert not q.ffn._can_group(x.view(-1, 64))   # fake-quant experts take the loop path
    set_quant_enabled(q, False)
    assert q.ffn._can_group(x.view(-1, 64))       # quant off: float math again, grouped is exact
    block.to(torch.float32)
    assert block.ffn._packed is None             # moved: packing dropped, loop path
