"""The Triton decode of integer codes (``runtime/fused_codes.py``, ``StackCodes.decode`` on CUDA)
gives what ``formats.dequantize_int`` gives (``StackCodes.decode_reference``), bit for bit.

CI has no GPU: the kernel runs under Triton's interpreter on CPU tensors (conftest.run_interpreted)
over packed (<= 4 bits: two codes a byte) and byte codes, symmetric and zero-point grids, groups
and per-channel rows, every code of the grid present, an expert range inside the stack and a
weight count that is no multiple of a program's block. The interpreter casts fp32 -> bf16 by
truncation (the GPU rounds to nearest even: benchmarks/check_block_rounding_kernels.py compares
bf16 there), so here bf16 is checked for its dtype and the values are compared in fp32.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    # name: (bits, symmetric, granularity, group, shape [E, R, C])
    "w4-asym-g32": (4, False, "group", 32, (5, 6, 96)),
    "w4-sym-g128": (4, True, "group", 128, (3, 7, 256)),
    "w3-asym-g16": (3, False, "group", 16, (4, 5, 48)),
    "w2-asym-g64": (2, False, "group", 64, (3, 9, 128)),
    "w4-asym-channel": (4, False, "channel", None, (3, 5, 40)),
    "w8-sym-channel": (8, True, "channel", None, (3, 4, 40)),
    "w8-asym-g32": (8, False, "group", 32, (2, 70, 64)),   # 8960 weights: 2.2 programs
}


def _codes(name: str, seed: int):
    """A StackCodes of random codes, scales and zero points (every code of the grid drawn)."""
    from amct_ext.quant import formats
    from amct_ext.quant.schemes import TensorSpec
    from amct_ext.quant.stack_codes import StackCodes

    bits, sym, gran, group, shape = CASES[name]
    spec = TensorSpec("int", bits, sym, gran, group)
    g = torch.Generator().manual_seed(seed)
    sc = StackCodes(shape, spec, torch.device("cpu"))
    pub = formats.scale_shape(shape[1:], spec)
    for e in range(shape[0]):
        q = torch.randint(sc.qmin, sc.qmax + 1, shape[1:], generator=g)
        scale = torch.rand(pub, generator=g) * 0.1 + 1e-3
        zp = None if sym else torch.randint(0, 2 ** bits, pub, generator=g).to(torch.uint8)
        sc.put(e, (0, shape[1]), q, scale, zp)
    return sc


def interpreted_checks() -> dict:
    """(child process) per case: mismatches of the kernel's fp32 decode against the reference,
    over the whole stack and an inner expert range; whether the bf16 output has its dtype."""
    from amct_ext.runtime import fused_codes

    torch.set_num_threads(1)
    res = {}
    for name in CASES:
        for seed in (0, 1):
            sc = _codes(name, seed)
            block = sc.spec.group_size if sc.spec.granularity == "group" else sc.shape[2]
            out = {}
            for e0, e1 in ((0, sc.shape[0]), (1, sc.shape[0] - 1)):
                zp = None if sc.zero_point is None else sc.zero_point[e0:e1]
                got = fused_codes.decode(sc.codes[e0:e1], sc.scale[e0:e1], zp, (e1 - e0,) + sc.shape[1:], block,
                                         sc.qmin, sc.packed, torch.float32)
                want = sc.decode_reference(e0, e1, torch.float32)
                out[f"{e0}:{e1}"] = int((got != want).sum())
            bf16 = fused_codes.decode(sc.codes, sc.scale, sc.zero_point, sc.shape, block, sc.qmin, sc.packed,
                                      torch.bfloat16)
            res[f"{name}-{seed}"] = {"mismatch": out, "bf16_dtype": bf16.dtype == torch.bfloat16,
                                     "distinct": int(sc.decode_reference(0, sc.shape[0], torch.float32).unique().numel())}
    return res


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("tests.test_fused_codes")


@pytest.mark.parametrize("name", list(CASES))
def test_the_decode_kernel_equals_dequantize_int(interpreted, name):
    for seed in (0, 1):
        r = interpreted[f"{name}-{seed}"]
        assert r["bf16_dtype"], r
        assert r["distinct"] > 8, r   # the values are not degenerate
        for rng, mismatch in r["mismatch"].items():
            assert mismatch == 0, (rng, r)


def test_the_cpu_decode_is_the_reference():
    """Off CUDA ``decode`` is ``decode_reference`` (the kernel is CUDA's alone)."""
    sc = _codes("w4-asym-g32", 0)
    assert torch.equal(sc.decode(1, 4, torch.bfloat16), sc.decode_reference(1, 4, torch.bfloat16))
