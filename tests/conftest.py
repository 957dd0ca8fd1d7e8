import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return SHARED


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """Random tiny checkpoint (bf16 release layout, 2 shards, tokenizer, mtp keys)."""
    from models.deepseek_v4.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), fmt="bf16", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_fp8(tmp_path_factory) -> Path:
    """The same random weights stored like the release: FP8 block linears, FP4 experts."""
    from models.deepseek_v4.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fp8"), fmt="fp8", seed=0)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: tiny tensors gain nothing from threads (on a busy
    2-core box they cost ~10x), and PTQ results are bit-reproducible only at a fixed count.
    Module scope, so it is in force before module-scoped fixtures compute their results."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny_adapter(tiny_ckpt):
    from amct_ext.base import RunConfig
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    adapter = DeepseekV4Adapter(RunConfig(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False))
    yield adapter
    adapter.close()


@pytest.fixture(scope="session")
def wiki_test_raw(shared_dir) -> Path:
    """The raw Wikitext-2 test split; part of ../shared in every checkout and CI run."""
    path = shared_dir / "data" / "wikitext-2-raw" / "wiki.test.raw"
    assert path.is_file(), f"{path} is missing: the tests need ../shared/data"
    return path
