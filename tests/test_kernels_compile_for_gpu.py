"""The hc backward kernels compile for a GPU without one: Triton's compiler and its bundled ptxas
build them for an H100 / H200 (sm_90) here, with no spill to local memory.

CI has no GPU; the interpreter tests (tests/test_fused_attention.py) check what the kernels
compute, but the interpreter accepts code the compiler refuses (a block shape, a type) and says
nothing of registers (casebook i34-9: a spilling kernel ran at a quarter of the bandwidth). These
kernels were written and checked in a session the device did not serve (casebook i34-10)."""
import os
import subprocess
import tempfile

import pytest
import triton  # the test extra installs it

from models.deepseek_v4 import fused_hc

HC_MIX = {"rows_ptr": "*bf16", "w_ptr": "*fp32", "y_ptr": "*bf16", "a_ptr": "*fp32", "out_ptr": "*bf16", "D": "i32"}
DOTS = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "D": "i32"}
PRE_GRAD = {"x_ptr": "*bf16", "gy_ptr": "*bf16", "pre_ptr": "*fp32", "g_lin_ptr": "*fp32", "c_ptr": "*fp32",
            "out_ptr": "*bf16", "D": "i32"}
# (kernel, runtime signature, constexprs) as fused_hc launches them on V4's stream (hc 4, D 4096)
CASES = {
    "mix-pre": (fused_hc._hc_mix_kernel, HC_MIX, {"K": 4, "J": 1, "HAS_Y": False, "BLOCK_D": 1024}),
    "mix-post": (fused_hc._hc_mix_kernel, HC_MIX, {"K": 4, "J": 4, "HAS_Y": True, "BLOCK_D": 1024}),
    "dots-1": (fused_hc._hc_dots_kernel, DOTS, {"K": 4, "J": 1, "BLOCK_D": 256}),
    "dots-4": (fused_hc._hc_dots_kernel, DOTS, {"K": 4, "J": 4, "BLOCK_D": 256}),
    "pre-grad": (fused_hc._hc_pre_grad_kernel, PRE_GRAD, {"K": 4, "BLOCK_D": 1024}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hc_kernel_compiles_for_sm90_without_spills(case, monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))  # as launched
    kernel, signature, constexprs = CASES[case]
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin = compiled.asm["cubin"]
    assert len(cubin) > 1000, case
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(x for x in usage.splitlines() if "REG:" in x)
    # registers that do not fit spill to the thread's stack frame (local memory)
    assert {"STACK:0", "LOCAL:0"} <= set(line.split()), f"{case} spills to local memory: {line.strip()}"


def test_the_compiled_blocks_are_the_launched_ones():
    """CASES compile the block sizes fused_hc launches with (a new default needs a new case)."""
    import inspect

    def default(fn):
        return inspect.signature(fn).parameters["block_d"].default

    assert default(fused_hc.hc_mix) == CASES["mix-post"][2]["BLOCK_D"] == CASES["mix-pre"][2]["BLOCK_D"]
    assert default(fused_hc.hc_dots) == CASES["dots-4"][2]["BLOCK_D"] == CASES["dots-1"][2]["BLOCK_D"]
    assert default(fused_hc._hc_pre_input_grad) == CASES["pre-grad"][2]["BLOCK_D"]
