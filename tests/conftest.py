import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Everything the tests read ships with the project (a fresh clone has nothing beside it).
DATA = REPO / "amct_ext" / "data"
WIKI_TEST_RAW = DATA / "wikitext-2-raw" / "wiki.test.raw"     # evaluation only
WIKI_VALID = DATA / "wikitext-2" / "wiki.valid.tokens"        # calibration / training
import models.deepseek_v4  # noqa: E402,F401  (registers V4's ModelBinding: amct_ext.base.model_binding)

CONFIGS = REPO / "models" / "deepseek_v4" / "configs"         # V4-Flash / V4-Pro config.json


def load_script(relpath: str, name: str | None = None):
    """A repository script that is no package module (benchmarks/scripts/*.py, tools/*.py) as a
    module; registered in sys.modules under ``name`` (dataclasses look their module up there)."""
    import importlib.util

    name = name or Path(relpath).stem
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod
def stored_tensors(folder) -> dict:
    """Every tensor a sharded safetensors checkpoint folder stores, as stored (FP8 / FP4 codes and
    scales undecoded), read through its model.safetensors.index.json."""
    import json

    from safetensors import safe_open

    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(Path(folder) / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def library_job(output_dir, **options) -> dict:
    """The main job through the library entry point, as tests and benchmarks call it:
    ``run_job(plan_job(PtqOptions(output_dir, **options)))`` (options by the CLI's flag names);
    its report. torch's thread count is restored after (the job sets its own)."""
    from amct_ext.pipeline.job_runner import run_job
    from amct_ext.pipeline.options import PtqOptions, plan_job

    old = torch.get_num_threads()
    try:
        return run_job(plan_job(PtqOptions(output_dir=str(output_dir), **options)))
    finally:
        torch.set_num_threads(old)


def run_interpreted(module: str, function: str = "interpreted_checks"):
    """``module.function()`` run in a child process under Triton's interpreter, its JSON result.
    TRITON_INTERPRET=1 must be set before Triton is imported: Triton's own library functions
    (tl.sum, tl.max, ...) are jitted at import, so the interpreter cannot be switched on inside
    this process once Triton is loaded. CI has no GPU: this is how the kernels run there."""
    import json
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    code = f"import json, {module} as t; print(json.dumps(t.{function}()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SPEC = REPO / "models" / "deepseek_v4" / "SPEC.md"


def _shared_layout() -> Path:
    """A temporary folder laid out like the old shared-data folder beside the checkout (data/, configs/, spec/), made of
    links to the shipped files, for tests written against that layout (``shared_dir``)."""
    root = Path(tempfile.mkdtemp(prefix="amct-shared-"))
    atexit.register(shutil.rmtree, root, True)
    links = {"data/wikitext-2-raw/wiki.test.raw": WIKI_TEST_RAW, "data/wikitext-2/valid.txt": WIKI_VALID,
             "spec/deepseek-v4.md": SPEC}
    links.update({f"configs/{p.name}": p for p in CONFIGS.glob("*.config.json")})
    for rel, src in links.items():
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            dst.symlink_to(src)
        except OSError:  # no symlinks (some Windows setups): copy
            shutil.copyfile(src, dst)
    return root


SHARED = _shared_layout()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The old shared-data layout (data/, configs/, spec/) rebuilt from shipped files; new tests
    use the fixtures and constants below directly."""
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
def wiki_test_raw() -> Path:
    """The raw Wikitext-2 test split shipped in amct_ext/data (evaluation only)."""
    assert WIKI_TEST_RAW.is_file(), f"{WIKI_TEST_RAW} is missing from the checkout"
    return WIKI_TEST_RAW


@pytest.fixture(scope="session")
def wiki_valid() -> Path:
    """The Wikitext-2 validation split shipped in amct_ext/data (calibration / training)."""
    assert WIKI_VALID.is_file(), f"{WIKI_VALID} is missing from the checkout"
    return WIKI_VALID


# ----------------------------------------------------------------------------- test tiers
# `pytest -m fast`: the unit-level files of tests/tiers.py (one declared list; test_tiers.py guards it)
def pytest_configure(config):
    config.addinivalue_line("markers", "fast: unit-level tier, `python -m pytest -q -m fast tests` (tests/tiers.py)")


def _fast_only(config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "fast"


def pytest_ignore_collect(collection_path, config):
    """Under `-m fast` the other test files are not imported at all (the same tests are selected)."""
    from tests.tiers import FAST_FILES

    if _fast_only(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return collection_path.name not in FAST_FILES or None
    return None


@pytest.hookimpl(tryfirst=True)      # before the mark plugin selects by `-m`
def pytest_collection_modifyitems(config, items):
    from tests.tiers import FAST_FILES

    report = os.environ.get("AMCT_FAST_TIER_REPORT")      # test_tiers.py: what the tier reaches
    fast = {}
    for item in items:
        if item.path.name in FAST_FILES and item.path.parent == Path(__file__).parent:
            item.add_marker(pytest.mark.fast)
            fast[item.nodeid] = sorted(getattr(item, "fixturenames", ()))
    if report:
        import json

        Path(report).write_text(json.dumps(fast))
