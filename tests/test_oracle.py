"""Our float reference vs transformers' independent DeepseekV4ForCausalLM on the same checkpoint."""
import pytest
import torch
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from models.deepseek_v4 import load_checkpoint_model


@pytest.fixture(scope="module")
def ours_fp32(tiny_ckpt):
    return load_checkpoint_model(tiny_ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_fp32(tiny_ckpt):
    model, info = HFDeepseekV4.from_pretrained(tiny_ckpt, dtype=torch.float32, output_loading_info=True)
    # the oracle must really have loaded every tensor (random init would make the test meaningless)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    return model.eval()


def ids_for(batch, seqlen, seed):
    return torch.randint(2, 512, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "batch, seqlen",
    [
        (2, 37),    # not a multiple of 4 or 128, several windows (W = 8)
        (3, 5),     # shorter than the window, no compressed entry yet
        (2, 160),   # > 128: ratio-128 layer has an entry, ratio-4 indexer selects top-k of 40
        (1, 131),   # odd length past one ratio-128 block
    ],
)
def test_fp32_logits_match_oracle(ours_fp32, hf_fp32, batch, seqlen):
    ids = ids_for(batch, seqlen, seqlen)
    with torch.no_grad():
        ours = ours_fp32(ids)
        ref = hf_fp32(ids).logits.float()
    assert ours.shape == (batch, seqlen, 512) and ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    print(f"\nB={batch} S={seqlen}: max|ours - transformers| = {diff:.2e} (logit scale {ref.abs().max():.2f})")
    assert diff <= 1e-4


def test_batch_rows_are_independent(ours_fp32):
    """Batch > 1 (upstream breaks there): each row equals the same sequence run alone."""
    ids = ids_for(3, 45, 7)
    with torch.no_grad():
        together = ours_fp32(ids)
        alone = torch.cat([ours_fp32(ids[i:i + 1]) for i in range(3)])
    assert (together - alone).abs().max().item() <= 1e-5


def test_bf16_within_bf16_noise(tiny_ckpt, ours_fp32, hf_fp32):
    """In bf16 our error against fp32 stays within 1.5x of transformers' own bf16 error."""
    ours_bf16 = load_checkpoint_model(tiny_ckpt, dtype=torch.bfloat16)
    hf_bf16 = HFDeepseekV4.from_pretrained(tiny_ckpt, dtype=torch.bfloat16).eval()
    ids = ids_for(2, 64, 3)
    with torch.no_grad():
        ref = ours_fp32(ids)
        ours = ours_bf16(ids)
        theirs = hf_bf16(ids).logits.float()
    assert ours.dtype == torch.float32
    err_ours = (ours - ref).abs().mean().item()
    err_hf = (theirs - ref).abs().mean().item()
    print(f"\nbf16 mean |err| vs fp32: ours {err_ours:.4f}, transformers {err_hf:.4f}")
    assert err_ours <= 1.5 * err_hf + 1e-3
    assert err_ours <= 0.05 * ref.abs().mean().item()


def test_fp8_checkpoint_dequantizes_like_independent_decode(tiny_ckpt_fp8):
    """An FP8/FP4 checkpoint loads to the dequantized weights computed here from the raw shard bytes."""
    from safetensors import safe_open
    import json

    model = load_checkpoint_model(tiny_ckpt_fp8, dtype=torch.float32)
    index = json.loads((tiny_ckpt_fp8 / "model.safetensors.index.json").read_text())["weight_map"]

    def raw(key):
        with safe_open(tiny_ckpt_fp8 / index[key], framework="pt") as f:
            return f.get_tensor(key)

    # FP8: value * 2^(e8m0 - 127), per 128x128 block
    key = "layers.1.attn.wq_b.weight"
    w, s = raw(key), raw("layers.1.attn.wq_b.scale")
    assert w.dtype == torch.float8_e4m3fn
    exp = s.view(torch.uint8).int() - 127
    scale = torch.pow(2.0, exp.float()).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    expected = w.float() * scale
    assert torch.equal(model.layers[1].attn.wq_b.weight, expected)

    # FP4: low nibble = even column; code -> {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign
    key = "layers.2.ffn.experts.3.w2.weight"
    packed, s = raw(key).view(torch.uint8), raw("layers.2.ffn.experts.3.w2.scale")
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
    lo, hi = table[(packed & 0xF).long()], table[(packed >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)
    scale = torch.pow(2.0, (s.view(torch.uint8).int() - 127).float()).repeat_interleave(32, 1)
    assert torch.equal(model.layers[2].ffn.experts[3].w2.weight, values * scale)


def test_fp8_checkpoint_runs_close_to_bf16(tiny_ckpt, tiny_ckpt_fp8, ours_fp32):
    fp8 = load_checkpoint_model(tiny_ckpt_fp8, dtype=torch.float32)
    ids = ids_for(2, 40, 11)
    with torch.no_grad():
        a, b = ours_fp32(ids), fp8(ids)
    rel = ((a - b).norm() / a.norm()).item()
    print(f"\nfp8/fp4 checkpoint vs bf16 checkpoint: relative logit error {rel:.3f}")
    assert torch.isfinite(b).all() and rel < 0.35
