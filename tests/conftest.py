import os
import sys
from pathlib import Path

import pytest

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
