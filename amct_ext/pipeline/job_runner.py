"""The main job as a library call: ``run_job(job)`` runs a checked plan (``job.PtqJob``).

tools/run_ptq.py parses its flags into the plan (``job.build_job``) and calls :func:`run_job`;
benchmarks and tests that want the job itself call it the same way. One process, or one rank
under torchrun (``distributed.py``): the reference perplexities, the PTQ loop
(``workflow.run_blockwise_ptq``), the PTQ perplexity and the MTP layer's cost, the summary,
report.json, and the export when the plan has one.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from ..runtime import device as devmod
from .job import PtqJob


def run_job(job: PtqJob, *, phases: Any = None, t_start: float | None = None) -> dict[str, Any] | None:
    """Run ``job``; returns its report (what OUTPUT/report.json holds), or None on a torchrun
    rank other than the first. ``phases``: an ``amct_ext.pipeline.phases.PhaseTimer`` given to the
    PTQ loop (benchmarks/bench_ptq.py reads its per-phase times and memory). ``t_start``: when the
    job began (perf_counter; default now), for the report's wall time."""
    import torch

    from . import distributed
    from .progress import interactive
    from .workflow import check_seq_len, layer_range

    from .run_folder import RunFolder

    t_start = time.perf_counter() if t_start is None else t_start
    dist = distributed.env_from()
    # the output folder is this run's until it ends: a second run on it is refused now, not after
    # its perplexities (rank 0 holds it for a torchrun job; released when `folder` goes)
    folder = RunFolder(job.output.dir).lock() if dist is None or dist.rank == 0 else None  # noqa: F841
    if job.runtime.threads:
        torch.set_num_threads(job.runtime.threads)
    if dist is not None:   # quantized predecessors make the layers sequential: refused under torchrun
        distributed.check_propagate(job.spec.propagate)
        dist = distributed.init(dist, job.runtime.device)   # each rank on the device of its LOCAL_RANK
        distributed.install_stop_handler(dist)
        distributed.start_watchdog(dist)
    main_rank = dist is None or dist.is_main
    if main_rank and not job.runtime.quiet:
        print(job.describe(), flush=True)
    run = _JobRun(job, dist, main_rank, phases)
    # bars on a terminal; in a log file (not a TTY) plain lines instead (PtqProgress), no escape codes
    with job.model.spec.adapter(run.run_config(progress=not job.runtime.quiet and main_rank and interactive())) \
            as adapter:
        if job.runtime.device_memory_gb is not None:
            devmod.cap_memory(adapter.device, int(job.runtime.device_memory_gb * 2 ** 30), "--device-memory-gb")
        check_seq_len(adapter, job.spec.calibration.seq_len, "--seq-len")
        run.layers = layer_range(adapter, job.output.layers.start, job.output.layers.stop)
        run.open(adapter)
        run.reference_perplexities(adapter)
        if job.ptq:
            run.ptq(adapter)
        elif main_rank and job.evaluation.enabled:
            from .summary import format_ppl

            print(format_ppl(run.ppl), flush=True)
        report = run.report(adapter, t_start)
    if not main_rank:
        return None
    run.finish(report)
    return report


class _JobRun:
    """One job's state between its steps (what tools/run_ptq.py's ``run`` held in locals)."""

    def __init__(self, job: PtqJob, dist: Any, main_rank: bool, phases: Any):
        self.job, self.dist, self.main_rank, self.phases = job, dist, main_rank, phases
        self.ptq_cfg = job.ptq_config()
        self.spec = job.ptq_spec(self.ptq_cfg)
        self.eval_cfg = job.eval_config()
        self.runtime = job.ptq_runtime()
        self.ppl: dict[str, float | None] = {"float": None, "rtn": None, "quant": None}
        self.peaks: list[int] = []
        self.evals: dict[str, Any] = {}
        # static activation quantizers left in float because no calibration data reached them
        self.unobserved: dict[str, int] = {}
        self.units: list = []
        self.groups: list = []
        self.ptq_memory = None
        self.ptq_wall = None
        self.mtp_report = None
        self.res = None
        self.layers: range | None = None

    def run_config(self, progress: bool) -> Any:
        from ..base import RunConfig

        return RunConfig(model_path=self.job.model.path,
                         device=str(self.dist.device) if self.dist else self.job.runtime.device,
                         dtype=self.job.torch_dtype, progress=progress)

    def open(self, adapter) -> None:
        """The windows, the output folder's fingerprint check, the evaluation function."""
        from ..errors import ConfigError
        from . import distributed
        from .workflow import evaluate_blockwise, load_calib_windows, load_eval_windows, prepare_params_dir

        job = self.job
        self.exported = adapter.exported is not None
        if self.exported and job.ptq:
            raise ConfigError(f"{job.model.path} is an exported quantized checkpoint ({adapter.exported.format}); "
                              "evaluate it with --no-ptq --eval-ppl (its float PPL applies the declared "
                              "activation quantization)")
        self.calib = load_calib_windows(adapter, self.ptq_cfg)
        if job.ptq:
            prepare_params_dir(adapter, job.output.dir, self.spec, create=False, calib_windows=self.calib)
        # one process: the workflow itself; torchrun: its scale-out over the ranks
        self.evaluate = (evaluate_blockwise if self.dist is None
                         else functools.partial(distributed.evaluate, self.dist))
        self.windows = load_eval_windows(adapter, self.eval_cfg) if job.evaluation.enabled else None

    def _evaluate(self, adapter, mode: str, **kw) -> Any:
        return self.evaluate(adapter, self.windows, self.eval_cfg, mode, scheme=self.spec.scheme,
                             targets=self.spec.targets, layers=self.layers, **kw)

    def reference_perplexities(self, adapter) -> None:
        if not self.job.evaluation.enabled:
            return
        for mode in (("float",) if self.exported else self.job.evaluation.modes):
            r = self._evaluate(adapter, mode, calib_windows=self.calib, calib_batch_size=self.ptq_cfg.batch_size)
            self.ppl[mode] = r.ppl
            self.evals[mode] = r.to_dict()
            if mode == "rtn":
                self.unobserved["rtn"] = r.unobserved_static
            self.peaks.append(r.memory.peak_memory_bytes)
            if self.main_rank:
                print(f"ppl[{mode}] = {r.ppl:.4f}  ({r.n_windows} windows x {r.seq_len}, {r.seconds:.1f} s)",
                      flush=True)

    def ptq(self, adapter) -> None:
        """The PTQ loop with its layer record and progress, then the PTQ perplexity, the MTP
        layer's cost and the summary."""
        from ..export.job import write_layers_record
        from . import distributed
        from .progress import PtqProgress, done_units, interactive
        from .workflow import PARAMS_DIR, run_blockwise_ptq

        job, out, layers = self.job, self.job.output.dir, self.layers
        stems = job.model.spec.unit_stems(adapter.config, self.spec.scheme, self.spec.targets, list(layers))
        pdir = out / PARAMS_DIR
        if self.main_rank:   # the run's range first: an interrupted run is then known to be incomplete
            pdir.mkdir(parents=True, exist_ok=True)
            write_layers_record(pdir, layers, stems)
        progress = PtqProgress(job.units_per_layer,
                               enabled=self.main_rank and not job.runtime.quiet and not interactive(),
                               done_before=done_units(pdir, stems),
                               on_layer_done=lambda i: write_layers_record(pdir, layers, stems))
        t_ptq = time.perf_counter()
        self.runtime.phases = self.phases
        if self.dist is None:
            self.runtime.on_unit_done = progress.unit_done
            res = run_blockwise_ptq(adapter, self.spec, out, layers=layers, calib_windows=self.calib,
                                    runtime=self.runtime)
        else:
            res = distributed.run_ptq(self.dist, adapter, self.spec, out, layers=layers, calib_windows=self.calib,
                                      boundary=job.runtime.boundary, runtime=self.runtime)
        self.res = res
        self.ptq_wall = time.perf_counter() - t_ptq
        self.units = res.units
        self.unobserved["ptq_calibration"] = res.unobserved_static
        self.ptq_memory = res.memory.to_dict()
        self.peaks.append(res.memory.peak_memory_bytes)
        if self.main_rank:
            write_layers_record(pdir, layers, stems)
        if job.evaluation.enabled:
            self.ptq_perplexity(adapter, pdir)
        from .summary import format_summary, summarize_units

        self.groups = summarize_units(self.units)
        if self.main_rank:
            print(format_summary(self.groups, self.ppl if job.evaluation.enabled else None), flush=True)

    def ptq_perplexity(self, adapter, pdir: Path) -> None:
        from .mtp_eval import evaluate_mtp

        r = self._evaluate(adapter, "ptq", params_dir=pdir)
        self.ppl["quant"] = r.ppl
        self.evals["ptq"] = r.to_dict()
        self.unobserved["ptq"] = r.unobserved_static
        self.peaks.append(r.memory.peak_memory_bytes)
        if self.main_rank:
            print(f"ppl[ptq] = {r.ppl:.4f}  ({r.seconds:.1f} s)", flush=True)
            # issue 23.6: the MTP layer's quantization cost (amct_ext/pipeline/mtp_eval.py)
            self.mtp_report = evaluate_mtp(adapter, self.windows, self.eval_cfg, self.spec.scheme,
                                           self.spec.targets, pdir)
            if self.mtp_report is not None:
                print(f"{adapter.extra_layers or 'extra layers'}: {self.mtp_report}", flush=True)

    def report(self, adapter, t_start: float) -> dict[str, Any]:
        """report.json (the keys in their order of old)."""
        import torch

        job, cfg, layers, recipe = self.job, self.ptq_cfg, self.layers, job_recipe(self.job)
        s = self.spec
        report = {
            "model": job.model.label, "model_path": str(job.model.path), "scheme": self.spec.scheme.name,
            "scheme_fingerprint": self.spec.scheme.fingerprint(), "quant_target": list(self.spec.targets),
            "layers": [layers.start, layers.stop], "device": str(adapter.device), "dtype": job.runtime.dtype,
            "threads": torch.get_num_threads(),
            "calibration": {"path": str(cfg.calib_path), "samples": cfg.n_samples, "seq_len": cfg.seq_len,
                            "epochs": cfg.epochs, "lr": cfg.lr, "seed": cfg.seed},
            "eval": None if not job.evaluation.enabled else {
                "path": str(job.evaluation.config.data_path), "windows": int(self.windows.shape[0]),
                "first_window": self.eval_cfg.first_window, "seq_len": cfg.seq_len},
            "recipe": None if recipe is None else {"algorithms": recipe.settings(), "propagate": s.propagate,
                                                   "holdout": s.holdout, "guard": s.guard,
                                                   "source": job.recipe_source},
            "plan_seconds": job.seconds,
            "ptq_wall_s": self.ptq_wall,
            "ppl": self.ppl,
            "summary": [g.to_dict() for g in self.groups],
            # units whose stored codes the run kept bit for bit (already on the target grid)
            "units_keeping_source_codes": sum(g.kept_source for g in self.groups),
            "units": [{"name": u.name, "kind": u.kind, "layer": u.layer, "loss_before": u.loss_before,
                       "loss_after": u.loss_after, "seconds": u.seconds, "n_calls": u.n_calls,
                       "resumed": u.resumed, "stats": u.stats} for u in self.units],
            "evaluations": self.evals,
            # the MTP evaluation, under the model's name for its extra layers (V4: "mtp")
            adapter.extra_layers or "extra_layers": self.mtp_report,
            "unobserved_static_quantizers": self.unobserved,
            "ptq_runtime": {"capture_memory_gb": job.runtime.capture_memory_gb, "sharded": job.runtime.sharded_ptq,
                            "hessian_memory_gb": job.runtime.hessian_memory_gb,
                            "batch_size": cfg.batch_size, "memory": self.ptq_memory},
            "wall_s": time.perf_counter() - t_start,
            "peak_memory_bytes": max(self.peaks) if self.peaks else devmod.peak_memory_bytes(adapter.device),
            "peak_memory_note": ("process peak RSS (cpu)" if adapter.device.type == "cpu"
                                 else f"{adapter.device.type} allocator peak"),
        }
        if self.dist is not None:   # PTQ peaks are gathered over the ranks; evaluation peaks are rank 0's
            report["distributed"] = {"world_size": self.dist.world_size, "boundary": job.runtime.boundary,
                                     "ptq_ranges": ([[r.start, r.stop] for r in self.res.ranges] if job.ptq
                                                    else None),
                                     "ptq_rank_seconds": None if not job.ptq else self.res.rank_seconds}
        return report

    def finish(self, report: dict[str, Any]) -> None:
        """Rank 0 after the model is closed: the export, report.json, the plot, the last lines."""
        from ..io.io_utils import atomic_write_json
        from .summary import write_error_plot

        job, out = self.job, self.job.output.dir
        if job.export is not None:
            report["export"] = export_after_run(job)
        atomic_write_json(report, out / "report.json")
        plot = write_error_plot(self.groups, out / "layer_errors.png") if self.groups else None
        mem, capture_gb = self.ptq_memory, job.runtime.capture_memory_gb
        if mem is not None and mem.get("call_memory_peak_bytes"):
            # the capture's own accounting (capture.CALL_METER): what the budget bounds
            print(f"captured calls in host memory at once: {mem['call_memory_peak_bytes'] / 2**30:.2f} GiB "
                  f"(the capture store {mem['capture_memory_peak_bytes'] / 2**30:.2f} GiB, budget "
                  + (f"{capture_gb:g} GiB" if capture_gb is not None else "none")
                  + f"; spilled {mem['capture_spilled_bytes'] / 2**30:.2f} GiB)", flush=True)
        if any(self.unobserved.values()):
            print("static activation quantizers left in float (no calibration data reached them): "
                  + ", ".join(f"{k} {v}" for k, v in self.unobserved.items()), flush=True)
        print(f"wrote {out / 'report.json'}" + (f" and {plot.name}" if plot else "")
              + f"  (wall {report['wall_s']:.1f} s, peak memory {report['peak_memory_bytes'] / 2**20:.0f} MiB)",
              flush=True)


def job_recipe(job: PtqJob) -> Any:
    """The recipe the job runs (the legacy solver's learned_clip included)."""
    return job.spec.recipe


def export_after_run(job: PtqJob) -> dict[str, Any]:
    """``--export``: the finished run exported into OUTPUT/export-FORMAT (rank 0 alone: the
    other ranks have returned, so the export must not start a group)."""
    from ..export.export_format import finished_export
    from ..export.exporter import SUMMARY_FIELDS
    from ..export.job import ExportRequest, export_run

    eout = job.export.out_dir
    # a finished export of an earlier run is replaced; a partial one is resumed (the export's
    # own fingerprint refuses one made from other parameters)
    complete = finished_export(eout)
    ereq = ExportRequest(model_path=job.model.path, format=job.export.format, out_dir=eout, from_dir=job.output.dir,
                         scheme=job.export.scheme, device=job.runtime.device, dtype=job.runtime.dtype,
                         overwrite=complete, dequantize_rest=job.export.dequantize_rest,
                         progress=not job.runtime.quiet)
    return {k: v for k, v in export_run(ereq, allow_distributed=False).items()
            if k in SUMMARY_FIELDS}


__all__ = ["run_job", "export_after_run"]
