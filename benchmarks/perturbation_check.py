#!/usr/bin/env python
"""Is a quantized perplexity *below* float a real gain or noise? A control experiment.

The trained tiny model is small and was stopped early, so its float weights are not at a minimum
of the test loss: any perturbation moves the perplexity up or down a little. This script applies,
to the same weights the quantizer touches, perturbations with exactly the magnitudes of the RTN
error but random signs (W + s * (Q(W) - W), s = +-1 per element), over several seeds, and reports
the spread of the resulting perplexity next to float and RTN. A quantized result inside that spread
is indistinguishable from a random perturbation of the same size.

    python benchmarks/perturbation_check.py --scheme w4a16-g128 --target attn-linear --seeds 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amct_ext.quant import formats  # noqa: E402
from amct_ext.data import EVAL_DEFAULT  # noqa: E402
from amct_ext.pipeline.perplexity import load_eval_text, perplexity, tokenize_windows  # noqa: E402
from amct_ext.quant.schemes import load_scheme  # noqa: E402
from models.deepseek_v4 import load_checkpoint_model  # noqa: E402

ATTN_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "compressor.wkv",
                "compressor.wgate", "indexer.wq_b", "indexer.weights_proj")


def target_weights(model, target: str):
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name.startswith("layers."):
            continue
        is_moe = ".ffn.experts." in name or ".ffn.shared_experts." in name
        is_attn = ".attn." in name and any(name.endswith(s) for s in ATTN_LINEARS)
        if (target == "moe" and is_moe) or (target == "attn-linear" and is_attn):
            yield name, module.weight


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(REPO / "assets" / "tiny-v4"))
    ap.add_argument("--scheme", default="w4a16-g128")
    ap.add_argument("--target", choices=("attn-linear", "moe"), default="attn-linear")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--data-path", default=str(EVAL_DEFAULT))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    model = load_checkpoint_model(args.model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    windows = tokenize_windows(load_eval_text(args.data_path), tok, args.seq_len, args.eval_windows)
    spec = load_scheme(args.scheme).target(args.target).weight

    def ppl() -> float:
        with torch.no_grad():
            return perplexity(model, windows, batch_size=8, device="cpu", progress=False)

    weights = list(target_weights(model, args.target))
    originals = {n: w.detach().clone() for n, w in weights}
    errors = {n: formats.fake_quant(originals[n], spec) - originals[n] for n, _ in weights}
    float_ppl = ppl()

    def set_weights(sign_seed: int | None) -> None:
        gen = torch.Generator().manual_seed(sign_seed or 0)
        with torch.no_grad():
            for n, w in weights:
                e = errors[n]
                if sign_seed is not None:
                    e = e * (torch.randint(0, 2, e.shape, generator=gen) * 2 - 1).to(e.dtype)
                w.copy_(originals[n] + e)

    set_weights(None)
    rtn_ppl = ppl()
    perturbed = []
    for seed in range(1, args.seeds + 1):
        set_weights(seed)
        perturbed.append(ppl())
    result = {
        "scheme": args.scheme, "target": args.target, "n_weights": len(weights),
        "windows": int(windows.shape[0]), "seq_len": args.seq_len,
        "float": float_ppl, "rtn_weights_only": rtn_ppl, "random_sign_perturbations": perturbed,
        "perturbation_mean": statistics.mean(perturbed), "perturbation_stdev": statistics.pstdev(perturbed),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
