"""GPTQ's column sweep as one Triton kernel (amct_ext/runtime/fused_gptq.py) against the torch
sweep it replaces (``gptq._sweep_block``, itself pinned to the frozen reference loop by
test_gptq_solver_exact.py): bit for bit, -0.0 included, for every integer grid GPTQ runs it on.

CI has no GPU: the kernel runs under Triton's interpreter in a child process (TRITON_INTERPRET=1
must be set before Triton is imported, conftest.run_interpreted), and ``gptq_solve`` is made
to take the fused path on CPU there by switching its device check on."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted


class _Spec:
    """The fields of a weight spec the sweep reads."""

    def __init__(self, bits, symmetric, group_size=None):
        self.format, self.bits, self.symmetric = "int", bits, symmetric
        self.granularity = "group" if group_size else "channel"
        self.group_size = group_size

    def __hash__(self):
        return hash((self.bits, self.symmetric, self.group_size))

    def __eq__(self, other):
        return isinstance(other, _Spec) and hash(self) == hash(other)


def _problem(B, R, C, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(B, R, C, generator=g)
    W[:, 0, :7] = -0.0                       # signed zeros must come out as they went in
    X = torch.randn(B, 3 * C, C, generator=g)
    return W, X.transpose(1, 2) @ X


def _bits_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def interpreted_checks() -> dict:
    """(child process) {case: every output bit-identical to the torch sweep}."""
    import amct_ext.algorithms.gptq as gptq
    from amct_ext.quant import formats

    torch.set_num_threads(1)
    out = {}
    cases = {
        # per-channel static grids (w8a8, w4a16): S, Z given per element
        "int8-sym-channel": (_Spec(8, True), 2, 24, 200, False),
        "int4-asym-channel": (_Spec(4, False), 1, 17, 130, False),
        # dynamic groups of the block's width (w4a16-g128, w3a16-g128), with learned clip factors;
        # C = 320: a last block of 64 columns
        "int4-asym-g128-clip": (_Spec(4, False, 128), 2, 20, 320, True),
        "int3-asym-g128": (_Spec(3, False, 128), 1, 9, 256, False),
        "int4-sym-g128": (_Spec(4, True, 128), 1, 12, 128, False),
        # a static grid that changes along a row within a block (groups of 32 taken up front),
        # 70 rows: three programs of rows, the last one partly masked
        "int4-sym-static-g32-70-rows": (_Spec(4, True), 1, 70, 160, False),
        # act-order: columns permuted by decreasing diag(H), the static grid with them
        "int8-act-order": (_Spec(8, True), 2, 40, 128, False),
    }
    for name, (spec, B, R, C, with_clip) in cases.items():
        W, H = _problem(B, R, C, seed=len(out))
        act_order = name.endswith("act-order")
        if name.startswith("int4-sym-static-g32"):
            amax = W.reshape(B, R, C // 32, 32).abs().amax(-1, keepdim=True)
            S, _ = formats.int_qparams_from_range(-amax, amax, spec.bits, True)
            S, Z, clip = S.expand(B, R, C // 32, 32).reshape(B, R, C).contiguous(), None, None
        elif spec.group_size:
            S = Z = None
            clip = (0.8 + 0.2 * torch.rand(B, R, C // spec.group_size + (C % spec.group_size > 0),
                                           generator=torch.Generator().manual_seed(7))) if with_clip else None
        else:
            if spec.symmetric:
                amax = W.abs().amax(-1, keepdim=True)
                S, Z = formats.int_qparams_from_range(-amax, amax, spec.bits, True)
            else:
                S, Z = formats.int_qparams_from_range(W.amin(-1, keepdim=True), W.amax(-1, keepdim=True),
                                                      spec.bits, False)
            S, Z = S.expand(B, R, C).contiguous(), None if Z is None else Z.expand(B, R, C).contiguous()
            clip = None
        gptq.fused_kernels_enabled = lambda device: False
        ref = gptq.gptq_solve(W, H, spec, S=S, Z=Z, clip=clip, act_order=act_order)
        calls = []
        real = gptq.fused_sweep_block
        gptq.fused_sweep_block = lambda *a, **k: calls.append(1) or real(*a, **k)
        gptq.fused_kernels_enabled = lambda device: True
        got = gptq.gptq_solve(W, H, spec, S=S, Z=Z, clip=clip, act_order=act_order)
        gptq.fused_sweep_block = real
        out[name] = {"fused_blocks": len(calls),
                     "equal": [_bits_equal(a, b) for a, b in zip(got[:3], ref[:3])] + [torch.equal(got[3], ref[3])]}
    # a group narrower than the block (w2a16-g64: two groups a block) keeps the torch sweep
    W, H = _problem(1, 8, 128, seed=9)
    calls = []
    real = gptq.fused_sweep_block
    gptq.fused_sweep_block = lambda *a, **k: calls.append(1) or real(*a, **k)
    gptq.gptq_solve(W, H, _Spec(2, False, 64))
    gptq.fused_sweep_block = real
    out["g64-not-fused"] = {"fused_blocks": len(calls), "equal": [True]}
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("tests.test_fused_gptq")


@pytest.mark.parametrize("case", ["int8-sym-channel", "int4-asym-channel", "int4-asym-g128-clip",
                                  "int3-asym-g128", "int4-sym-g128", "int4-sym-static-g32-70-rows",
                                  "int8-act-order"])
def test_fused_sweep_is_bit_identical_to_the_torch_sweep(interpreted, case):
    res = interpreted[case]
    assert res["fused_blocks"] > 0, "the fused path was not taken"
    assert res["equal"] == [True, True, True, True], f"Q, S, Z, loss bit-identical: {res['equal']}"


def test_groups_narrower_than_the_block_keep_the_torch_sweep(interpreted):
    assert interpreted["g64-not-fused"]["fused_blocks"] == 0
