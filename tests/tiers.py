"""Test tiers. The whole suite is `python -m pytest -q -n 2 tests` (README); the FAST tier is
`python -m pytest -q -m fast tests`: unit-level test files (number formats, quantizers, schemes,
codecs, solvers on small matrices, static checks of the tree and of the evidence) that build no
checkpoint, start no process and run no job, >= 100 tests in under a minute on 2 busy cores
(README.md and ARCHITECTURE.md give the measured count and time).

The tier is declared here by file, so a file is fast or not as a whole; tests/conftest.py marks
every test of these files `fast` and, for `-m fast`, does not even import the other files (their
collection alone costs ~30 s on a busy box). tests/test_tiers.py (not itself fast: it collects the
tier in a child pytest) guards it: its size, and that no fast test reaches a checkpoint-building
fixture or names a whole-job entry point."""
from __future__ import annotations

#: test files (tests/<name>) of the fast tier
FAST_FILES = frozenset({
    "test_formats.py",                      # number formats as plain functions
    "test_quantizers.py",                   # weight / activation fake quantizers
    "test_schemes.py",                      # scheme configs and targets
    "test_storage_formats.py",              # release FP8 / FP4 codecs
    "test_dispatch.py",                     # per-layer device maps on meta modules
    "test_gptq_solver_exact.py",            # GPTQ solver == frozen reference on small matrices
    "test_exact_gemm.py",                   # fp32-island GEMM split
    "test_io_utils.py",                     # atomic writes, safe loads
    "test_device_checks.py",                # deferred NaN / Inf checks
    "test_headlines.py",                    # README / RESULTS speed figures == recorded medians
    "test_layer_speed_index.py",            # RESULTS index figures == their records
    "test_best_recipe_results.py",          # RESULTS peers section == its records
    "test_block_rounding_speed_results.py", # RESULTS block-rounding table == its runs
})

#: fixtures that build a checkpoint or a model adapter: a fast test must not reach them (directly
#: or through another fixture)
CHECKPOINT_FIXTURES = frozenset({"tiny_ckpt", "tiny_ckpt_fp8", "tiny_adapter", "shared_dir"})

#: names whose use in a fast file means a checkpoint, a whole job or another process
HEAVY_NAMES = ("make_tiny_checkpoint", "make_synthetic", "write_synthetic", "train_tiny", "run_ptq",
               "tiny-trained", "tiny_trained", "subprocess", "torchrun", "run_interpreted",
               "load_checkpoint_model", "DeepseekV4Adapter", "run_blockwise_ptq", "evaluate_blockwise",
               "plan_job", "run_job", "library_job")
