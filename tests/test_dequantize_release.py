"""tools/dequantize_release.py: the release-format tiny written as the plain float checkpoint peers
start from (issue 35.2's "exact bf16 dequantization"). Checked against three independent things:
the bf16 tiny's layout (keys, dtypes, shapes, config), the project's decoders applied to the
stored codes, and the two float models (ours from the release, ours from the dequantized folder:
equal logits bit for bit; transformers' DeepseekV4 loads every tensor and agrees within its
oracle tolerance)."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4
from transformers import AutoTokenizer

from amct_ext.io.storage_formats import decode_fp4, decode_fp8_block
from amct_ext.pipeline.perplexity import load_eval_text, tokenize_windows
from models.deepseek_v4 import load_checkpoint_model
from models.deepseek_v4.release_format import FP4_EXPERT, FP8_LINEAR
from tests.conftest import REPO, WIKI_TEST_RAW, load_script, stored_tensors

RELEASE = REPO / "assets" / "tiny-v4-release"
BF16_TINY = REPO / "assets" / "tiny-v4"
tool = load_script("tools/dequantize_release.py", "dequantize_release_tool")

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def deq(tmp_path_factory):
    out = tmp_path_factory.mktemp("deq") / "tiny-v4-release-bf16"
    assert tool.main(["--src", str(RELEASE), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def release_tensors():
    return stored_tensors(RELEASE)


def test_layout_is_the_bf16_tinys(deq):
    """Same keys, dtypes and shapes as assets/tiny-v4, the same config.json, the tokenizer files."""
    ours, ref = stored_tensors(deq), stored_tensors(BF16_TINY)
    assert sorted(ours) == sorted(ref)
    for k, t in ref.items():
        assert (ours[k].dtype, ours[k].shape) == (t.dtype, t.shape), k
    assert json.loads((deq / "config.json").read_text()) == json.loads((BF16_TINY / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (deq / name).read_bytes() == (RELEASE / name).read_bytes()
    assert not [p.name for p in deq.parent.iterdir() if p.name.startswith(".")]   # no temp folder left


def test_values_are_the_decoded_codes_exactly(deq, release_tensors):
    """Each FP8 / FP4 weight equals the project's decoder in fp32 exactly; every other tensor is
    the stored bytes."""
    ours = stored_tensors(deq)
    n = 0
    for k, t in release_tensors.items():
        if k.endswith(".scale"):
            continue
        if FP8_LINEAR.match(k) or FP4_EXPERT.match(k):
            decode = decode_fp8_block if FP8_LINEAR.match(k) else decode_fp4
            want = decode(t, release_tensors[k[:-6] + "scale"], dtype=torch.float32)
            assert ours[k].dtype == torch.bfloat16 and torch.equal(ours[k].float(), want), k
            n += 1
        else:
            assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k
    assert n == 34 + 96


def test_same_logits_as_the_release_bit_for_bit(deq):
    """Our float model from the dequantized folder IS `--model tiny-trained-release`'s."""
    tok = AutoTokenizer.from_pretrained(str(RELEASE))
    windows = tokenize_windows(load_eval_text(WIKI_TEST_RAW), tok, 256, 2)
    release = load_checkpoint_model(RELEASE, dtype=torch.float32)
    plain = load_checkpoint_model(deq, dtype=torch.float32)
    with torch.no_grad():
        a, b = release(windows), plain(windows)
    assert a.shape == (2, 256, 4096)
    assert torch.equal(a, b)
    # the oracle the peer scripts use loads every tensor of it and agrees with our forward
    hf, info = HFDeepseekV4.from_pretrained(str(deq), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        ref = hf.eval()(input_ids=windows[:1], use_cache=False).logits.float()
    # tests/test_oracle.py's bound for ours vs transformers on the bf16 tiny
    assert (a[:1] - ref).abs().max().item() <= 1.5e-5


def test_bad_input_one_line(tmp_path, capsys):
    assert tool.main(["--src", str(BF16_TINY), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a release-format checkpoint" in err and not (tmp_path / "x").exists()
    (tmp_path / "taken").mkdir()
    assert tool.main(["--src", str(RELEASE), "--out", str(tmp_path / "taken")]) == 2
    assert "--out" in capsys.readouterr().err and not list((tmp_path / "taken").iterdir())
    assert tool.main(["--src", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_value_outside_bf16_is_refused_and_fp32_keeps_it(tmp_path, capsys):
    """A ue8m0 scale of 2^-127 puts e4m3 products below bf16's smallest subnormal (2^-133): bf16
    output is refused naming the tensor; fp32 (subnormals to 2^-149) writes them exactly."""
    src = tmp_path / "src"
    shutil.copytree(RELEASE, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    key = "layers.0.attn.wq_a.scale"
    shard = src / index["weight_map"][key]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = torch.zeros_like(tensors[key].view(torch.uint8)).view(torch.float8_e8m0fnu)  # 2^-127
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert tool.main(["--src", str(src), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "'layers.0.attn.wq_a.weight'" in err and "--dtype fp32" in err and not (tmp_path / "b").exists()
    assert tool.main(["--src", str(src), "--out", str(tmp_path / "f"), "--dtype", "fp32"]) == 0
    got = stored_tensors(tmp_path / "f")["layers.0.attn.wq_a.weight"]
    want = decode_fp8_block(tensors["layers.0.attn.wq_a.weight"], tensors[key], dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want) and (want != 0).any()
    assert not torch.equal(want.bfloat16().float(), want)
