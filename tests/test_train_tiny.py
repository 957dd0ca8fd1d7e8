"""tools/train_tiny.py: a short CPU training run of the real V4 float model on WikiText-2 validation text."""
import json

import pytest
import torch

from tests.conftest import WIKI_VALID as VALID  # shipped validation split
from tests.conftest import load_script



def _load_tool():
    return load_script("tools/train_tiny.py")


tt = _load_tool()

# The smallest model with every layer kind: r0-hash, r4 (indexer)-score, r128-score, r4-score, + MTP entry.
SMALL_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 4, 128, 4, 0],
    "sliding_window": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "hc_sinkhorn_iters": 20,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 256,
}


def small_config(out=None, steps=30, **kw):
    base = dict(out=str(out) if out else None, vocab_size=300, steps=steps, batch_size=4, seq_len=128,
                lr=1e-2, warmup_steps=3, seed=123, device="cpu", time_budget_s=1e9, eval_every=steps,
                log_every=10, max_val_windows=4, model=dict(SMALL_MODEL), verbose=False)
    base.update(kw)
    return tt.TrainConfig(**base)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained-tiny")
    return out, tt.train(small_config(out))


def test_loss_decreases_on_real_text(trained):
    _, res = trained
    assert res.steps_done == 30 and len(res.losses) == 30
    first, last = sum(res.losses[:3]) / 3, sum(res.losses[-3:]) / 3
    print(f"\nloss {first:.3f} -> {last:.3f}; held-out {res.final_val_loss:.3f} (unigram {res.unigram_val_loss:.3f})")
    assert last < first - 0.5
    assert res.final_val_loss < res.losses[0]


def test_checkpoint_layout_and_log(trained):
    out, res = trained
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "train_log.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) == 2
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("mtp.0.") for k in weight_map)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128, 4, 0] and cfg["num_hash_layers"] == 1 and cfg["hc_mult"] == 4
    assert "dim" not in cfg  # official names only
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps_done"] == 30 and log["seed"] == 123
    assert log["final_val_loss"] == pytest.approx(res.final_val_loss)
    assert 0 < res.checkpoint_bytes <= tt.MAX_CHECKPOINT_BYTES


def test_checkpoint_loads_and_matches_transformers(trained):
    from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

    from models.deepseek_v4 import load_checkpoint_model

    out, res = trained
    ours, account = load_checkpoint_model(out, dtype=torch.float32, return_account=True)
    assert not account.unexpected and account.skipped  # mtp.* skipped, everything else loaded
    hf, info = HFDeepseekV4.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    hf.eval()
    ids = torch.randint(2, 300, (2, 140), generator=torch.Generator().manual_seed(0))  # > 128: r128 entry
    with torch.no_grad():
        a = ours(ids)
        b = hf(ids).logits.float()
        trained_bf16 = res.model.to(torch.float32)(ids)
    diff = (a - b).abs().max().item()
    print(f"\nmax|ours - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    # the written weights are the trained ones (up to bf16 storage)
    assert (a - trained_bf16).abs().mean().item() < 0.05 * trained_bf16.abs().mean().item() + 0.05


def test_same_seed_same_losses(trained):
    _, res = trained
    again = tt.train(small_config(None, steps=30))
    assert again.losses == res.losses
    assert again.final_val_loss == res.final_val_loss


def test_size_guard_refuses_large_model(tmp_path):
    big = dict(SMALL_MODEL, hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=16)
    with pytest.raises(tt.ConfigError, match="over the 16 MB limit"):
        tt.train(small_config(tmp_path / "big", steps=1, model=big))


def test_refuses_test_split(tmp_path):
    from tests.conftest import WIKI_TEST_RAW

    fake = tmp_path / "corpus.txt"   # renamed test text: refused by content, not by name
    fake.write_text("".join(WIKI_TEST_RAW.read_text(encoding="utf-8").splitlines(True)[:80]))
    with pytest.raises(tt.AmctError, match="evaluation text"):
        tt.train(small_config(None, steps=1, text_path=str(fake)))
