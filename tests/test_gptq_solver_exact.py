"""The lean GPTQ column sweep (issue 24) against a frozen copy of the straightforward loop it
replaced: the same grid values, scales and zero points bit for bit (float64 and float32, every
grid kind, act-order, dead columns, a learned clip, a partial last block); the objective, now
summed per lazy block, to float64 rounding."""
from __future__ import annotations

import pytest
import torch

from amct_ext.algorithms.gptq import gptq_solve
from amct_ext.quant import formats
from amct_ext.quant.schemes import TensorSpec

from tests.gptq_reference import reference_solve as _reference_solve

pytestmark = pytest.mark.usefixtures("one_thread")


CASES = [  # (spec, act_order, clip)
    (TensorSpec("int", 4, False, "group", 32), False, False),
    (TensorSpec("int", 4, False, "group", 32), False, True),
    (TensorSpec("int", 4, True, "group", 32), False, True),
    (TensorSpec("int", 4, False, "group", 32), True, False),
    (TensorSpec("int", 3, True, "channel"), False, False),
    (TensorSpec("int", 3, True, "channel"), True, False),
    (TensorSpec("int", 2, False, "block", None, (8, 32)), False, False),
    (TensorSpec("fp8", 8, True, "block", None, (16, 32)), False, False),
    (TensorSpec("mxfp4"), True, False),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("spec,act_order,use_clip", CASES,
                         ids=lambda v: f"{v.format}{v.bits}-{v.granularity}-{'s' if v.symmetric else 'a'}"
                         if isinstance(v, TensorSpec) else str(v))
def test_lean_sweep_equals_reference_bit_for_bit(dtype, spec, act_order, use_clip):
    torch.manual_seed(7)
    B, R, C = 3, 16, 160
    W = (torch.randn(B, R, C) * 0.5).to(dtype)
    X = torch.randn(B, 300, C) @ (torch.eye(C) + 0.3 * torch.randn(C, C) / C ** 0.5)
    X[:, :, 5] = 0                                             # a dead column
    H = (2 / 300 * X.transpose(1, 2) @ X).to(dtype)
    dynamic = spec.format == "int" and spec.granularity == "group" and not act_order
    S = Z = clip = None
    if dynamic:
        if use_clip:
            clip = (0.8 + 0.2 * torch.rand(B, R, C // spec.group_size)).to(dtype)
    else:
        Ss, Zs = [], []
        for w in W:
            s, z = formats.qparams(w, spec)
            Ss.append(formats.expand_qparam(s, w.shape, spec))
            if z is not None:
                Zs.append(formats.expand_qparam(z, w.shape, spec))
        S = torch.stack(Ss)
        Z = torch.stack(Zs) if Zs else None
    for block_size in (48, 40):                                # partial last blocks either way
        ref = _reference_solve(W, H, spec, S=S, Z=Z, clip=clip, block_size=block_size, act_order=act_order)
        new = gptq_solve(W, H, spec, S=S, Z=Z, clip=clip, block_size=block_size, act_order=act_order)
        assert torch.equal(new[0], ref[0]), "grid values differ"
        assert torch.equal(new[1], ref[1]), "scales differ"
        assert (new[2] is None) == (ref[2] is None)
        if ref[2] is not None:
            assert torch.equal(new[2], ref[2]), "zero points differ"
        torch.testing.assert_close(new[3], ref[3], rtol=1e-12, atol=0)
    rtn = torch.stack([formats.fake_quant(w, spec) for w in W]).to(dtype)
    assert not torch.equal(ref[0], rtn), "the case must exercise error propagation (GPTQ != RTN)"
