"""The fused Triton kernels (sparse attention, hc mixes, per-token int fake quant) compute what
the torch paths compute.

CI has no GPU, so the kernel runs here under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
tensors, in fp32: the interpreter's bf16 dot is wrong (it multiplies the raw uint16 storage), so
the bf16 numerics are checked on the GPU by ``benchmarks/check_fused_attention.py`` (RESULTS.md §4).
The torch path itself is checked against transformers in tests/test_oracle.py."""

import pytest
import torch

import models.deepseek_v4.modeling as modeling
from amct_ext.runtime import device as D
from amct_ext.quant.schemes import load_scheme
from models.deepseek_v4.quant_module import quantize_block
from models.deepseek_v4.tiny import random_tiny_model
from tests.conftest import run_interpreted

pytestmark = pytest.mark.usefixtures("one_thread")

# (layer, batch, seq len); layer 2 is a ratio-128 layer, run with r = 8 so that a short sequence
# has several causal entries (both paths read the ratio from the module)
CASES = [(0, 2, 21), (1, 2, 37), (2, 2, 40)]
CAUSAL_RATIO = 8
LAUNCHES = [{}, {"block_n": 16, "value_splits": 1}]


@pytest.fixture(scope="module")
def interpreted_errors():
    """Every case in a child process under Triton's interpreter (conftest.run_interpreted)."""
    return run_interpreted("tests.test_fused_attention")


def interpreted_checks() -> dict:
    """(child process) max-abs between the interpreted kernel and the torch path, per case."""
    from models.deepseek_v4 import fused_attention

    assert fused_attention.triton_available(), "the test extra installs triton"
    torch.set_num_threads(1)
    errors = {}
    for layer, bsz, seqlen in CASES:
        attn = random_tiny_model(0, dtype=torch.float32).layers[layer].attn
        if attn.ratio > 4:
            attn.ratio = CAUSAL_RATIO
        q, kv, comp_kv, comp_idx = _inputs(attn, bsz, seqlen, seed=layer)
        with torch.no_grad():
            ref = attn.sparse_attention(q, kv, comp_kv, comp_idx)      # CPU: the torch path
            for i, launch in enumerate(LAUNCHES):
                got = fused_attention.fused_sparse_attention(q, kv, attn.attn_sink, attn.softmax_scale,
                                                             attn.window, comp_kv, comp_idx, attn.ratio, **launch)
                assert got.shape == ref.shape
                errors[f"{layer}-{i}"] = (got - ref).abs().max().item()
    errors.update(_hc_checks())
    errors.update(_hc_grad_checks())
    errors.update(_index_checks())
    errors.update(_swiglu_checks())
    errors.update(_fq_checks())
    errors.update(_grouped_gemm_checks())
    errors.update(_norm_rope_checks())
    q24 = torch.randn(1, 4, 2, 24)
    try:
        fused_attention.fused_sparse_attention(q24, torch.randn(1, 4, 24), torch.zeros(2), 1.0, 8)
        errors["refuses-odd-head-dim"] = False
    except ValueError as e:
        errors["refuses-odd-head-dim"] = "power-of-two head_dim" in str(e)
    return errors


def _index_checks() -> dict:
    """(child process) the indexer score kernel against the torch path's score, fp32 operands
    (the interpreter's bf16 dot is wrong, see the module doc); T and Nc not multiples of the blocks."""
    from models.deepseek_v4 import fused_attention
    from models.deepseek_v4.modeling import causal_entry_mask

    g = torch.Generator().manual_seed(6)
    res = {}
    for bsz, seqlen in ((2, 45), (1, 90)):
        q = torch.randn(bsz, seqlen, 4, 16, generator=g)
        keys = torch.randn(bsz, seqlen // 4, 16, generator=g)
        w = torch.randn(bsz, seqlen, 4, generator=g)
        logits = (q @ keys.unsqueeze(1).transpose(-1, -2)).relu()                 # [B, S, Ih, Nc]
        want = (w.unsqueeze(-2) @ logits).squeeze(-2)
        want = want.masked_fill(~causal_entry_mask(seqlen, keys.shape[1], 4, q.device), float("-inf"))
        got = fused_attention.fused_index_score(q, keys, w, 4, block_t=16, block_n=16)
        same_inf = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
        finite = torch.isfinite(want)
        res[f"index-{seqlen}"] = (got[finite] - want[finite]).abs().max().item() if same_inf else float("inf")
    return res


def _swiglu_checks() -> dict:
    """(child process) the clamped SwiGLU kernel against MoE.route_grouped's torch expression, fp32."""
    import torch.nn.functional as F
    from models.deepseek_v4.fused_moe import clamped_swiglu

    g = torch.Generator().manual_seed(8)
    res = {}
    for limit in (0.0, 3.0):
        h = torch.randn(37, 2 * 80, generator=g) * 4                      # I = 80: not a multiple of the block
        w = torch.rand(37, generator=g)
        gate, up = h[:, :80], h[:, 80:]
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        want = F.silu(gate) * up * w.unsqueeze(-1)
        got = clamped_swiglu(h, limit, w, block=32)
        res[f"swiglu-{limit}"] = (got - want).abs().max().item()
        res[f"swiglu-{limit}-noweight"] = (clamped_swiglu(h, limit, None, block=32) - F.silu(gate) * up).abs().max().item()
    # the routed-expert combine: bit-identical to gathering and adding in fp32, in order
    from models.deepseek_v4.fused_moe import combine_rows
    y = torch.randn(60, 70, generator=g).to(torch.bfloat16)
    rows = torch.stack([torch.randperm(60, generator=g)[:6].sort().values for _ in range(10)])
    want = y[rows[:, 0]].float()
    for j in range(1, 6):
        want += y[rows[:, j]]
    res["combine-diff"] = int((combine_rows(y, rows, block=32) != want).sum())
    return res


def _grouped_gemm_checks() -> dict:
    """(child process) the grouped expert GEMM (plain and with the SwiGLU epilogue) against a loop
    over experts in fp32, max-abs error relative to the largest output: empty experts, experts spanning several row tiles, K not a multiple of
    BLOCK_K, N not a multiple of BLOCK_N."""
    import torch.nn.functional as F
    from models.deepseek_v4.fused_moe import grouped_gemm

    g = torch.Generator().manual_seed(12)
    launch = {"block_m": 16, "block_n": 16, "block_k": 32, "group_m": 2}
    counts = torch.tensor([10, 0, 37, 7, 0, 8])                       # expert 2: three row tiles
    ends = torch.cumsum(counts, 0)
    rows, k, n = int(counts.sum()), 80, 40
    a = torch.randn(rows, k, generator=g)
    w = torch.randn(len(counts), 2 * n, k, generator=g)
    rw = torch.rand(rows, generator=g)
    want = torch.cat([a[int(e - c):int(e)] @ w[i].t() for i, (c, e) in enumerate(zip(counts, ends))])
    rel = lambda got, ref: ((got - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    res = {"gg-plain": rel(grouped_gemm(a, w, ends, launch), want)}
    for limit in (0.0, 2.0):
        gate, up = want[:, :n], want[:, n:]
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        ref = F.silu(gate) * up * rw.unsqueeze(-1)
        got = grouped_gemm(a, w, ends, launch, swiglu_limit=limit, row_weights=rw)
        res[f"gg-swiglu-{limit}"] = rel(got, ref)
    return res


def _norm_rope_checks() -> dict:
    """(child process) the RMSNorm and in-place rope kernels against modeling's torch expressions
    (fp32; rope on [B, S, C] and [B, S, H, C], strided cos / sin rows as the compressor passes)."""
    from models.deepseek_v4.fused_norm_rope import rms_norm, rope_inplace

    g = torch.Generator().manual_seed(13)
    res = {}
    norm = modeling.RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g))
        x = torch.randn(3, 7, 96, generator=g) * 3
        res["norm-weight"] = (rms_norm(x, norm.weight, 1e-6) - norm(x)).abs().max().item()
        x = torch.randn(5, 3, 64, generator=g)                            # several rows per program
        res["norm-heads"] = (rms_norm(x, None, 1e-6) - modeling.head_rms_norm(x, 1e-6)).abs().max().item()
    cos, sin = modeling._rope_table(modeling.rope_frequencies(8, 10000.0, 1.0, 0, 0.0, 0.0), 64, "cpu")
    errs = []
    for shape in ((2, 9, 3, 40), (2, 9, 24)):
        x = torch.randn(*shape, generator=g)
        for inverse in (False, True):
            for step in (1, 4):
                c, s = cos[::step][:shape[1]], sin[::step][:shape[1]]
                want = modeling.apply_rope(x.clone(), c, s, inverse=inverse)   # CPU: the torch path
                errs.append((rope_inplace(x.clone(), c, s, inverse=inverse) - want).abs().max().item())
    res["rope"] = max(errs)
    return res


def _hc_checks() -> dict:
    """(child process) the hc-mix kernel against the torch expressions of hc_pre / hc_post:
    max-abs in fp32, and the share of elements off by more than one bf16 step in bf16."""
    from models.deepseek_v4.fused_hc import hc_mix, hc_weights
    from models.deepseek_v4.modeling import hc_pre

    g = torch.Generator().manual_seed(3)
    res = {}
    # the weights (sigmoids, softmax, 20 Sinkhorn iterations) against hc_pre's torch path: the mix
    # is recovered from hc_pre's inputs; T = 70 is not a multiple of the token block
    hc, dim, iters, eps = 4, 8, 20, 1e-6
    x = torch.randn(2, 35, hc, dim, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=g) * 0.3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g) * 0.5
    _, post_ref, comb_ref = hc_pre(x, fn, scale, base, hc, iters, eps, 1e-6)
    flat = x.flatten(-2)
    mix = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre, post, comb = hc_weights(mix, scale, base, hc, iters, eps, block_t=16)
    pre_ref = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + eps
    res["hc-weights"] = max((pre - pre_ref).abs().max().item(), (post - post_ref).abs().max().item(),
                            (comb - comb_ref).abs().max().item())
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, 4, 100, generator=g).to(dtype)               # D not a multiple of the block
        y = torch.randn(2, 5, 100, generator=g).to(dtype)
        pre = torch.rand(2, 5, 4, generator=g)
        post, comb = torch.rand(2, 5, 4, generator=g) * 2, torch.rand(2, 5, 4, 4, generator=g)
        want_pre = (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(dtype)
        want_post = (post.unsqueeze(-1) * y.float().unsqueeze(-2)
                     + torch.einsum("bskj,bskd->bsjd", comb, x.float())).to(dtype)
        got_pre = hc_mix(x, pre.unsqueeze(-1), block_d=64).squeeze(-2)
        got_post = hc_mix(x, comb, y, post, block_d=64)
        for name, got, want in (("pre", got_pre, want_pre), ("post", got_post, want_post)):
            assert got.shape == want.shape and got.dtype == want.dtype
            if dtype == torch.float32:
                res[f"hc-{name}-fp32"] = (got - want).abs().max().item()
            else:  # FMA contraction may move an fp32 result across a bf16 rounding boundary
                step = want.float().abs().clamp_min(1e-3) * 2 ** -7
                res[f"hc-{name}-bf16-off"] = ((got.float() - want.float()).abs() > step).float().mean().item()
    return res


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _hc_grad_checks() -> dict:
    """(child process) the hc mixes under autograd (fused_hc._HcPre / _HcPost) against autograd
    through modeling's torch expressions, fp32: values and every input gradient, as the largest
    error relative to the largest reference entry; then a whole block, fused hc against torch hc."""
    from models.deepseek_v4 import fused_hc
    from models.deepseek_v4.modeling import hc_post, hc_pre, hc_weights_torch

    g = torch.Generator().manual_seed(5)
    res = {}
    hc, dim, iters, eps, norm_eps = 4, 100, 20, 1e-6, 1e-6               # D not a multiple of the blocks
    x = torch.randn(2, 7, hc, dim, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g) * 0.5
    cot = [torch.randn(2, 7, dim, generator=g), torch.randn(2, 7, hc, generator=g),
           torch.randn(2, 7, hc, hc, generator=g)]
    outs, grads = [], []
    for fused in (False, True):
        xi = x.clone().requires_grad_(True)
        if fused:
            o = fused_hc.hc_pre_fused(xi, fn, scale, base, hc, iters, eps, norm_eps, None, hc_weights_torch)
        else:
            o = hc_pre(xi, fn, scale, base, hc, iters, eps, norm_eps)   # CPU: the torch path
        sum((a * b).sum() for a, b in zip(o, cot)).backward()
        outs.append(o)
        grads.append(xi.grad)
    res["hc-pre-out"] = max(_rel(a, b) for a, b in zip(outs[1], outs[0]))
    res["hc-pre-grad-x"] = _rel(grads[1], grads[0])
    ins = [torch.randn(2, 7, dim, generator=g), torch.randn(2, 7, hc, dim, generator=g),
           torch.rand(2, 7, hc, generator=g) * 2, torch.rand(2, 7, hc, hc, generator=g)]
    cot = torch.randn(2, 7, hc, dim, generator=g)
    outs, grads = [], []
    for fn_post in (hc_post, fused_hc.hc_post_fused):
        leaves = [t.clone().requires_grad_(True) for t in ins]
        o = fn_post(*leaves)
        (o * cot).sum().backward()
        outs.append(o)
        grads.append([t.grad for t in leaves])
    res["hc-post-out"] = _rel(outs[1], outs[0])
    for name, a, b in zip(("y", "res", "post", "comb"), grads[1], grads[0]):
        res[f"hc-post-grad-{name}"] = _rel(a, b)
    res.update(_hc_block_grad_checks())
    return res


def _hc_block_grad_checks() -> dict:
    """(child process) one tiny block's forward and backward with the fused hc ends against the
    torch ones: the gradient of its input and of one attention and one expert weight. The hc
    parameters are frozen, as in block-wise rounding."""
    block = random_tiny_model(0, dtype=torch.float32).layers[0]
    for p in block.parameters():
        p.requires_grad_(False)
    named = dict(block.named_parameters())
    tuned = [n for n in named if named[n].dim() == 2 and n.startswith("attn.")][:1] + \
        [n for n in named if named[n].dim() >= 2 and n.startswith("ffn.") and "gate" not in n][:1]
    for n in tuned:
        named[n].requires_grad_(True)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 9, block.hc_mult, named["ffn_norm.weight"].shape[0], generator=g)
    ids = torch.randint(0, 100, (2, 9), generator=g)
    cot = torch.randn(x.shape, generator=g)
    torch_way = modeling._use_fused_hc
    fused_calls = []

    def fused_anywhere(x, *frozen):  # the kernels on CPU tensors (the interpreter)
        fused_calls.append(not any(p.requires_grad for p in frozen))
        return fused_calls[-1]

    results = []
    try:
        for use in (torch_way, fused_anywhere):
            modeling._use_fused_hc = use
            xi = x.clone().requires_grad_(True)
            out = block(xi, 0, ids)
            gx, *gw = torch.autograd.grad((out * cot).sum(), [xi] + [named[n] for n in tuned])
            results.append((out.detach(), gx, gw))
    finally:
        modeling._use_fused_hc = torch_way
    (o0, gx0, gw0), (o1, gx1, gw1) = results
    out = {"hc-block-out": _rel(o1, o0), "hc-block-grad-x": _rel(gx1, gx0)}
    out.update({f"hc-block-grad-{n}": _rel(a, b) for n, a, b in zip(tuned, gw1, gw0)})
    out["hc-block-tuned"] = tuned
    out["hc-block-fused-calls"] = sum(fused_calls)
    return out


def _inputs(attn, bsz, seqlen, seed):
    g = torch.Generator().manual_seed(seed)
    h, dh = attn.n_heads, attn.head_dim
    q = torch.randn(bsz, seqlen, h, dh, generator=g)
    kv = torch.randn(bsz, seqlen, dh, generator=g)
    comp_kv = comp_idx = None
    if attn.ratio:
        n = seqlen // attn.ratio
        comp_kv = torch.randn(bsz, n, dh, generator=g)
        if attn.ratio == 4:
            # k picks per query among its allowed entries, in random order, -1 where there are fewer
            k = 6
            comp_idx = torch.full((bsz, seqlen, k), -1, dtype=torch.long)
            for b in range(bsz):
                for t in range(seqlen):
                    allowed = (t + 1) // attn.ratio
                    pick = torch.randperm(allowed, generator=g)[:k] if allowed else torch.empty(0, dtype=torch.long)
                    comp_idx[b, t, :len(pick)] = pick
    with torch.no_grad():
        attn.attn_sink.copy_(torch.randn(h, generator=g) * 2)
    return q, kv, comp_kv, comp_idx


@pytest.mark.parametrize("layer, bsz, seqlen", CASES)
@pytest.mark.parametrize("launch", range(len(LAUNCHES)))
def test_kernel_equals_torch_path(interpreted_errors, layer, bsz, seqlen, launch):
    """Ratio 0 (window only), ratio 4 (indexer picks with -1 slots), causal compressed entries;
    S longer than the window (8) everywhere; causal entries with r = 8 (five of them at S = 40)."""
    err = interpreted_errors[f"{layer}-{launch}"]
    assert err < 2e-5, f"layer {layer}: max-abs {err:.3g} between the fused kernel and the torch path"


@pytest.mark.parametrize("seqlen", [45, 90])
def test_index_score_kernel_equals_torch(interpreted_errors, seqlen):
    assert interpreted_errors[f"index-{seqlen}"] < 2e-5


@pytest.mark.parametrize("case", ["swiglu-0.0", "swiglu-3.0", "swiglu-3.0-noweight"])
def test_swiglu_kernel_equals_torch(interpreted_errors, case):
    assert interpreted_errors[case] < 1e-5


@pytest.mark.parametrize("case", ["gg-plain", "gg-swiglu-0.0", "gg-swiglu-2.0"])
def test_grouped_gemm_kernel_equals_expert_loop(interpreted_errors, case):
    # fp32 sums of 80 products and Triton's exp: ~1e-6 of the largest output; a wrong expert,
    # row tile or column would be off by O(1)
    assert interpreted_errors[case] < 5e-6


@pytest.mark.parametrize("case", ["norm-weight", "norm-heads", "rope"])
def test_norm_and_rope_kernels_equal_torch(interpreted_errors, case):
    assert interpreted_errors[case] < 2e-6


def test_combine_kernel_is_bit_identical(interpreted_errors):
    assert interpreted_errors["combine-diff"] == 0


def test_hc_weights_kernel_equals_torch(interpreted_errors):
    assert interpreted_errors["hc-weights"] < 1e-5


HC_GRAD_CASES = ["pre-out", "pre-grad-x", "post-out", "post-grad-y", "post-grad-res", "post-grad-post",
                 "post-grad-comb", "block-out", "block-grad-x"]


@pytest.mark.parametrize("case", HC_GRAD_CASES)
def test_hc_mixes_under_autograd_equal_torch(interpreted_errors, case):
    """fused_hc's autograd Functions give torch's values and gradients (fp32, 20 Sinkhorn steps)."""
    assert interpreted_errors[f"hc-{case}"] < 2e-6


def test_a_block_tunes_through_the_fused_hc_ends(interpreted_errors):
    """A block under autograd takes the fused hc at all four ends (two hc_pre, two hc_post), and an
    attention and an expert weight get torch's gradients through them."""
    assert interpreted_errors["hc-block-fused-calls"] == 4
    tuned = interpreted_errors["hc-block-tuned"]
    assert [n.split(".")[0] for n in tuned] == ["attn", "ffn"]
    for name in tuned:
        assert interpreted_errors[f"hc-block-grad-{name}"] < 2e-6


@pytest.mark.parametrize("name", ["pre", "post"])
def test_hc_mix_kernel_equals_torch(interpreted_errors, name):
    assert interpreted_errors[f"hc-{name}-fp32"] < 1e-5
    assert interpreted_errors[f"hc-{name}-bf16-off"] == 0.0


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_int_token_kernel_is_bit_identical(interpreted_errors, dtype, bits):
    assert interpreted_errors[f"fq-{dtype}-{bits}-diff"] == 0


def test_int_token_kernel_counts_nan(interpreted_errors):
    assert interpreted_errors["fq-nan-count"] == 1


def test_kernel_refuses_non_power_of_two_head_dim(interpreted_errors):
    assert interpreted_errors["refuses-odd-head-dim"] is True


def test_fused_path_is_taken_only_for_the_float_function(monkeypatch):
    """Dispatch rule: CUDA + Triton, 16-bit, no autograd, plain unhooked matmuls."""
    attn = random_tiny_model(0, dtype=torch.bfloat16).layers[1].attn
    q = torch.randn(1, 12, attn.n_heads, attn.head_dim, dtype=torch.bfloat16)
    kv = torch.randn(1, 12, attn.head_dim, dtype=torch.bfloat16)
    assert not attn._use_fused_kernel(q, kv, None)                    # CPU: torch path
    monkeypatch.setattr(modeling, "fused_kernels_enabled", lambda device: True)
    with torch.no_grad():
        assert attn._use_fused_kernel(q, kv, None)
        assert not attn._use_fused_kernel(q.float(), kv.float(), None)  # fp32 dots would be TF32
    q.requires_grad_(True)
    assert not attn._use_fused_kernel(q, kv, None)                    # PTQ's backward pass
    q.requires_grad_(False)
    handle = attn.qk_matmul.register_forward_hook(lambda *a: None)
    assert not attn._use_fused_kernel(q, kv, None)                    # a capture hook must see the call
    handle.remove()
    block = random_tiny_model(0, dtype=torch.bfloat16).layers[1]
    qattn = quantize_block(block, load_scheme("kv8"), ["attn-cache"]).attn
    with torch.no_grad():
        assert not qattn._use_fused_kernel(q, kv, None)               # fake-quant K/V: torch path


def test_switch_and_backends(monkeypatch):
    assert not D.fused_kernels_enabled("cpu")
    monkeypatch.setattr(D, "_triton_importable", lambda: True)
    assert D.fused_kernels_enabled("cuda")
    monkeypatch.setenv(D.FAST_PATHS_ENV, "0")
    assert not D.fused_kernels_enabled("cuda")
    assert not D.fp32_out_gemm_supported("cuda")
    monkeypatch.delenv(D.FAST_PATHS_ENV)
    assert D.fp32_out_gemm_supported("cuda") and not D.fp32_out_gemm_supported("cpu")
    monkeypatch.setenv(D.FP32_ISLANDS_ENV, "strict")
    assert not D.fp32_out_gemm_supported("cuda") and D.fused_kernels_enabled("cuda")


def _fq_checks() -> dict:
    """(child process) the per-token int kernel against the torch definition (formats._fq_int):
    the number of differing elements (bit-identical expected), and its NaN count. The final cast
    to bf16 is checked on the GPU (benchmarks/check_fast_paths.py)."""
    from amct_ext.quant import formats
    from amct_ext.runtime import fused_quant
    from amct_ext.quant.schemes import TensorSpec

    g = torch.Generator().manual_seed(4)
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (8, 4):
            spec = TensorSpec("int", bits, True, "token", dynamic=True)
            x = (torch.randn(3, 7, 96, generator=g) * torch.rand(3, 7, 1, generator=g) * 5).to(dtype)
            x[0, 0] = 0                                                   # all-zero row: scale 1
            x[0, 1, :4] = torch.tensor([2.5, -2.5, 0.5, 127.0])            # ties and the grid edge
            # the interpreter truncates fp32 -> bf16 stores (compiled Triton rounds to nearest even),
            # so compare before the final cast: fp32 output, against the torch path on x.float()
            got, bad = fused_quant.fake_quant_int_token(x, bits, out_dtype=torch.float32)
            want = formats._fq_int(x.float(), spec, None)
            res[f"fq-{dtype}-{bits}-diff"] = int((got != want).sum()) + int(bad.item())
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    res["fq-nan-count"] = int(fused_quant.fake_quant_int_token(x, 8)[1].item())
    return res
