"""BaseModel: the adapter skeleton the blockwise workflows drive (no model-specific knowledge).

A blockwise run never holds the whole model. It needs, from the model, only these hooks:

- ``empty_weights_model()``   the model skeleton on the meta device (no memory);
- ``load_embed_state_dict()`` the small "stem" (embedding, final norm, head) loaded for real;
- ``block(i, sharded)``        decoder layer ``i`` built on demand (``release_block`` frees it);
- ``do_embedding_forward``     token windows -> the inputs of layer 0 (+ per-sample state);
- ``do_block_forward``         one layer over every sample;
- ``do_head_forward``          last hidden state -> fp32 logits for every position;
- ``iter_ptq_units``           the pieces of a (quantized) layer the PTQ solver calibrates;
- ``quantize_block``           wrap a float layer with fake-quant modules;
- ``set_quant_enabled``        switch a wrapped layer's quantizers off (float) / on.

The model contract: everything the framework asks of a model, declared here and nowhere else
(``amct_ext/`` never imports ``models/``; tests/test_layout.py refuses model names in its code):

- ``BaseModel``      the adapter of a running job: the abstract hooks above, the optional ones with
                     a default (``max_seq_len``, ``model_id``, ``mtp_layer_ids`` /
                     ``mtp_block_inputs`` / ``mtp_logits``, ``extra_layers``, ``layer_cost``,
                     ``unit_device``, ``block_sample_batch`` ...);
- ``ModelBinding``   what the export, the job plan and the torchrun split need without an adapter
                     (one per config.json ``model_type``; ``extra_layers`` / ``build_extra_layer``:
                     the extra (draft) layers the export groups and quantizes; the export's leaf
                     names: ``gated_projections``, ``module_patterns``, ``unquantized_modules``),
                     the vocabulary a recipe may name before any model is built:
                     ``smoothing_pairs``, ``wider_targets``, and the built-in model names the
                     library entry point takes (``model_names``, ``model_defaults``,
                     ``resolve_checkpoint``: ``pipeline.options.plan_job``);
- ``PtqUnit``        (pipeline/ptq_units.py) a solvable piece of a layer; its module may offer
                     ``SmoothableUnit`` (smoothing pairs) and ``GatedProjections`` (a gated MLP's
                     gate / up / down projections by role, and its activation clamp: routed
                     experts are stacked by role, never by the model's names);
- ``LayerPlacement`` (runtime/dispatch.py) how a sharded layer is spread over devices.

Per-sample state channel
------------------------
Some layers need more than the hidden state: DeepSeek-V4's hash-routed MoE layers need each
sample's ``input_ids``. ``do_embedding_forward`` stores one kwargs dict per sample in
``self.sample_state``; the default ``do_block_forward`` zips it with the inputs, so an adapter
does not re-implement the layer loop just to pass extra arguments (the AMCT case study's
"per-sample state channel").

Configuration travels in small explicit dataclasses (``RunConfig``, ``PtqConfig``,
``EvalConfig``) rather than one global ``args`` object, so every function states what it reads.
"""
from __future__ import annotations

import abc
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from .runtime import device as devmod, device_checks
from .errors import CheckpointError, ConfigError, DataError
from .pipeline.ptq_units import PtqUnit


# ------------------------------------------------------------------------------------ configs
# learned_clip's defaults (algorithms/learned_clip.py, --legacy-solver), shared by PtqConfig and the
# CLI (tools/run_ptq.py) so they cannot drift.
DEFAULT_EPOCHS = 2
DEFAULT_LR = 5e-3


@dataclass
class RunConfig:
    """Where the model comes from and where it runs.

    ``device``: 'auto' | 'npu' | 'cuda' | 'cpu' | 'cuda:1' ... (see ``device.resolve_device``).
    ``shard_devices``: devices a sharded layer is spread over; None = every device of the
    compute device's backend. Tests pass e.g. ['cpu', 'cpu', 'cpu'].
    ``dtype``: compute dtype of the non-fp32 parameters (the fp32 islands stay fp32).
    ``offload_hidden``: keep hidden states on the host between layers (device memory then holds
    one layer plus one batch, not the activations of every window).
    """

    model_path: str | os.PathLike
    device: str = "auto"
    shard_devices: Sequence[str] | None = None
    dtype: torch.dtype = torch.bfloat16
    offload_hidden: bool = True
    progress: bool = True


@dataclass
class PtqConfig:
    """Blockwise PTQ settings. ``seed`` fixes the calibration windows and the solver's RNG.

    ``calib_path=None``: the shipped WikiText-2 validation split. ``eval_paths``: evaluation
    texts the calibration text must not share a 64-word run with (the shipped test split is
    always checked)."""

    epochs: int = DEFAULT_EPOCHS
    lr: float = DEFAULT_LR
    n_samples: int = 8
    seq_len: int = 128
    batch_size: int = 1
    seed: int = 0
    calib_path: str | os.PathLike | None = None
    eval_paths: Sequence[str | os.PathLike] = ()

    def check(self) -> None:
        if self.epochs < 0:
            raise ConfigError(f"PtqConfig.epochs must be >= 0, got {self.epochs}")
        if not (self.lr > 0):
            raise ConfigError(f"PtqConfig.lr must be > 0, got {self.lr}")
        if self.n_samples < 1 or self.batch_size < 1:
            raise ConfigError(f"PtqConfig: n_samples and batch_size must be >= 1, "
                              f"got {self.n_samples}, {self.batch_size}")

    def solver_settings(self) -> dict[str, Any]:
        """The first entries of ptq_params/meta.json "solver" (``PtqSpec.solver_meta`` adds
        the recipe, propagation, holdout and guard). ``epochs`` / ``lr`` are the CLI's
        ``--epochs`` / ``--lr`` (``learned_clip``'s settings under ``--legacy-solver``, also
        the torchrun cost model's epochs); they stay in the fingerprint so that folders written
        before the recipe became the one path still resume."""
        return {"epochs": self.epochs, "lr": self.lr}

    def calibration_settings(self) -> dict[str, Any]:
        """How the calibration windows are drawn (meta.json "calibration", with the hashes of
        the text and of the windows the workflow adds)."""
        return {"samples": self.n_samples, "seq_len": self.seq_len, "seed": self.seed,
                "batch_size": self.batch_size}

    def calibration_text(self) -> Path:
        from .data import CALIB_DEFAULT

        return Path(self.calib_path) if self.calib_path is not None else CALIB_DEFAULT


@dataclass
class EvalConfig:
    """Perplexity settings: windows of ``seq_len`` tokens, ``max_windows`` of them from window
    ``first_window`` on (0: the first ones, the reported protocol; a later disjoint range is a dev
    split for choosing recipes, benchmarks/quality_table.py).
    ``data_path=None``: the shipped wikitext-2-raw-v1 test split (``amct_ext/data``)."""

    seq_len: int = 128
    max_windows: int | None = None
    first_window: int = 0
    batch_size: int = 1
    data_path: str | os.PathLike | None = None
    sharded: bool = False
    # replay each layer's forward from a CUDA graph after its first window (device.GraphedForward;
    # bit-identical, CUDA only, never for sharded layers); AMCT_GRAPHS=0 also turns it off
    graphs: bool = True

    def check(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"EvalConfig.batch_size must be >= 1, got {self.batch_size}")
        if self.max_windows is not None and self.max_windows < 1:
            raise DataError(f"EvalConfig.max_windows must be >= 1 or None, got {self.max_windows}")
        if self.first_window < 0:
            raise DataError(f"EvalConfig.first_window must be >= 0, got {self.first_window}")


def batches(windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Split ``[n, S]`` windows into consecutive ``[<=batch_size, S]`` samples (order kept)."""
    return [windows[i:i + batch_size] for i in range(0, windows.shape[0], batch_size)]


# ------------------------------------------------------------------------------------ model binding
class ModelBinding(abc.ABC):
    """What the framework needs to know about a model family WITHOUT a running adapter: the
    export (which works from a checkpoint folder and a finished run) and the torchrun cost
    model. A model package subclasses it and registers one instance per ``config.json``
    ``model_type`` (:func:`register_model_binding`); ``amct_ext/`` never imports ``models``."""

    #: the ``model_type`` of the config.json files this binding reads
    model_type: str = ""
    #: the smoothing pairs its units offer (``SmoothableUnit.smoothing_subgraphs``), by name: what
    #: ``--algo awq:pairs=A+B`` may name, checked when the recipe is parsed
    smoothing_pairs: tuple[str, ...] = ()
    #: the name of the model's extra layers after the decoder layers (draft / multi-token-prediction
    #: layers, layer ids n_layers + j): their checkpoint keys are ``{name}.{j}.*`` and the export's
    #: metadata and reports describe them under this name; '' = the model has none
    extra_layers: str = ""
    #: role -> name of its gated MLPs' projections (``GatedProjections.PROJECTIONS`` of its units:
    #: ``gate`` / ``up`` / ``down``), for the export, which works on leaf names: the down
    #: projection's input dim is what tensor parallelism splits; {} = no gated MLP
    gated_projections: dict[str, str] = {}
    #: per linear target (``attn-linear``, ``moe``), the module names / ``re:`` patterns that select
    #: its modules in a serving loader's names (the compressed-tensors config group's ``targets``;
    #: they must match the checkpoint's flat names and the loaders' renamed ones alike)
    module_patterns: dict[str, tuple[str, ...]] = {}
    #: modules the export never quantizes (heads, router, a draft layer's projections), as
    #: compressed-tensors ``ignore`` entries
    unquantized_modules: tuple[str, ...] = ("lm_head",)
    #: target names that select a wider module set than a linear target, with its specs: name ->
    #: ``attn-linear`` / ``moe`` (``quant.schemes.register_wider_target``, on registration: a
    #: recipe may name them before any model is built)
    wider_targets: dict[str, str] = {}

    @abc.abstractmethod
    def check_config(self, model_path: str | os.PathLike) -> None:
        """Refuse a config.json the model cannot be built from (one line naming the field)."""

    @abc.abstractmethod
    def load_config(self, model_path: str | os.PathLike) -> Any:
        """The model's config object (``n_layers``, ``compress_ratios``... as the binding needs)."""

    @abc.abstractmethod
    def build_layer(self, reader: Any, config: Any, layer_idx: int, dtype: torch.dtype,
                    device: torch.device) -> nn.Module:
        """Decoder layer ``layer_idx`` with its weights read by ``reader`` (a CheckpointReader)."""

    @abc.abstractmethod
    def quantize_block(self, block: nn.Module, scheme: Any, targets: Sequence[str]) -> nn.Module:
        """Wrap the layer for ``scheme`` / ``targets`` (as the adapter's ``quantize_block``)."""

    @abc.abstractmethod
    def iter_ptq_units(self, block: nn.Module, layer_idx: int, targets: Sequence[str]) -> Iterator[PtqUnit]:
        """The PTQ units of a quantized layer (as the adapter's ``iter_ptq_units``)."""

    @abc.abstractmethod
    def quantized_weights(self, block: nn.Module) -> dict[str, nn.Module]:
        """checkpoint weight name (relative to the block) -> the quantized leaf that holds it,
        for every leaf whose weight is quantized (what the export encodes)."""

    def build_extra_layer(self, reader: Any, config: Any, j: int, dtype: torch.dtype,
                          device: torch.device) -> nn.Module | None:
        """Extra layer ``j`` (``{extra_layers}.{j}.*``) built as a decoder block (layer id
        n_layers + j) with its weights, for the export to quantize; None when the checkpoint does
        not hold it as a whole block (the export then copies its tensors as they are). Default:
        None (no extra layer is ever quantized)."""
        return None

    #: the built-in model names this binding answers for (``pipeline.options.PtqOptions.model``,
    #: the CLI's ``--model``): each a checkpoint folder :meth:`resolve_checkpoint` finds, and the
    #: job's defaults :meth:`model_defaults` gives; () = only a checkpoint folder names the model
    model_names: tuple[str, ...] = ()

    def model_defaults(self, name: str | None) -> dict[str, Any]:
        """The job options (``PtqOptions`` field -> value) a run of model ``name`` takes where the
        caller left them unset (None); ``name`` None: a checkpoint given by its folder only.
        Default: none (the caller gives calibration and evaluation sizes itself)."""
        return {}

    def resolve_checkpoint(self, name: str | None, model_path: str | os.PathLike | None, download: bool,
                           calib_path: Path | None) -> Path:
        """The checkpoint folder of model ``name`` (``model_path`` given: that folder), weights
        present; ``download``: fetch a released one; ``calib_path``: the text a generated
        checkpoint's tokenizer is trained on. Default: ``model_path`` itself, checked to be a
        folder (no built-in names)."""
        if name is not None:
            raise ConfigError(f"model {name!r}: model_type {self.model_type!r} has no built-in models")
        if model_path is None or not Path(model_path).is_dir():
            raise CheckpointError(f"--model-path {model_path} does not exist or is not a folder")
        return Path(model_path)

    def plan_spec(self) -> Any:
        """The model's answers to the job plan (``amct_ext.pipeline.job.ModelPlanSpec``: config,
        index keys, scheme x shapes, unit file stems); the export asks it which layers a run
        completed. Models without one cannot check a run's layers."""
        raise ConfigError(f"model_type {self.model_type!r} has no job-plan spec (ModelBinding.plan_spec)")

    def check_export(self, export_cfg: Any, profile: Any, planned_params: Sequence[str] = ()) -> None:
        """Refuse (one line naming module, engine and flag) an export that ``profile``'s engine
        would reject or compute differently; called by ``ExportConfig.check`` before anything
        is written. The default knows no module of the model and accepts."""

    def served_tp_sizes(self, export_cfg: Any, profile: Any) -> list[int]:
        """The tensor-parallel sizes ``profile``'s engine can shard the export of ``export_cfg``
        over (recorded in the export's metadata); the default knows no layout: none listed."""
        return []

    def released_config_keys(self, config: Any) -> dict[str, Any]:
        """Keys the released config.json carries that an export must add when its source
        predates them (the serving engines read them); the default adds none."""
        return {}

    def layer_cost(self, config: Any, layer_idx: int, targets: Sequence[str], n_tokens: int, epochs: int) -> Any:
        """Seconds of one layer under the stated rates (``layer_cost.LayerCost``), for the
        torchrun layer split; the default counts every layer alike."""
        from .pipeline.layer_cost import LayerCost

        return LayerCost(float_s=1.0, solve_s=1.0 if targets else 0.0)


_BINDINGS: dict[str, ModelBinding] = {}


def register_model_binding(binding: ModelBinding) -> ModelBinding:
    """Make ``binding`` the one for config.json files of its ``model_type``."""
    if not binding.model_type:
        raise TypeError(f"{type(binding).__name__}.model_type is empty")
    from .quant.schemes import register_wider_target

    for name, spec_key in binding.wider_targets.items():
        register_wider_target(name, spec_key)
    _BINDINGS[binding.model_type] = binding
    return binding


def named_model_binding(name: str) -> ModelBinding:
    """The registered binding whose ``model_names`` holds ``name``; ConfigError listing the names
    known when none does."""
    for binding in _BINDINGS.values():
        if name in binding.model_names:
            return binding
    known = ", ".join(n for b in _BINDINGS.values() for n in b.model_names) or "none imported"
    raise ConfigError(f"model {name!r}: no registered model binding names it (known: {known}); "
                      "import its model package first, or give the checkpoint folder (model_path) instead")


def known_smoothing_pairs() -> tuple[str, ...]:
    """Every smoothing pair name the registered model bindings declare (registration order)."""
    return tuple(dict.fromkeys(name for b in _BINDINGS.values() for name in b.smoothing_pairs))


# ------------------------------------------------------------------------------------ unit hooks
@runtime_checkable
class SmoothableUnit(Protocol):
    """A unit module whose activations can be smoothed into a preceding weight (SmoothQuant,
    AWQ): ``smoothing_subgraphs()`` lists its pairs (``algorithms.smoothing.SmoothPair``: name,
    producer, readers), named as its binding's ``smoothing_pairs``."""

    def smoothing_subgraphs(self) -> list: ...


@runtime_checkable
class GatedProjections(Protocol):
    """A gated MLP unit (``down(act(gate(x)) * up(x))``): ``PROJECTIONS`` maps the roles ``gate``,
    ``up``, ``down`` to its attribute (= checkpoint) names, ``projection(role)`` returns the
    linear. Batched paths stack experts by role (``quant.quant_linear.QuantGatedMLP``). Its
    activation clamp (V4: ``swiglu_limit``, the per-channel ``up_limit``) is ``clamp_limit`` /
    ``channel_clamp()`` / ``set_channel_clamp()``: smoothing the up rows into the down projection
    scales it per channel."""

    PROJECTIONS: dict[str, str]
    #: its own activation clamp, ``|up| <= clamp_limit`` (0: none)
    clamp_limit: float

    def projection(self, role: str) -> nn.Module: ...

    def channel_clamp(self) -> torch.Tensor | None:
        """The per-channel clamp smoothing left after scaling the up rows (None: ``clamp_limit``)."""

    def set_channel_clamp(self, limit: torch.Tensor | None) -> None: ...


def model_binding(model_path: str | os.PathLike) -> ModelBinding:
    """The registered binding for the checkpoint at ``model_path`` (by its config.json
    ``model_type``); ConfigError naming the file when there is none."""
    import json

    cfg_path = Path(model_path) / "config.json"
    try:
        model_type = json.loads(cfg_path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{cfg_path}: cannot read the model_type ({type(e).__name__})") from None
    binding = _BINDINGS.get(model_type)
    if binding is None:
        known = ", ".join(sorted(_BINDINGS)) or "none imported"
        raise ConfigError(f"{cfg_path}: no model binding for model_type {model_type!r} (known: {known}); "
                          "import its model package first")
    return binding


# ------------------------------------------------------------------------------------ adapter
class BaseModel(abc.ABC):
    """Adapter skeleton. Subclasses implement the hooks marked abstract below."""

    #: the compute device (PTQ units move here; the stem lives here)
    device: torch.device

    def __init__(self, run: RunConfig):
        self.run = run
        self.model_path = Path(run.model_path)
        self.device = devmod.resolve_device(run.device)
        # one kwargs dict per sample, set by do_embedding_forward (see module docstring)
        self.sample_state: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ abstract hooks
    @property
    @abc.abstractmethod
    def num_layers(self) -> int:
        """Number of decoder layers of the main forward."""

    @abc.abstractmethod
    def empty_weights_model(self) -> nn.Module:
        """The whole model with every parameter and buffer on the meta device."""

    @abc.abstractmethod
    def load_embed_state_dict(self) -> None:
        """Load the stem (embedding, final norm, head, ...) into the skeleton, on ``self.device``."""

    @abc.abstractmethod
    def block(self, layer_idx: int, sharded: bool = False, device: str | torch.device | None = None) -> nn.Module:
        """Build decoder layer ``layer_idx`` with its weights.

        ``sharded=False``: on ``device``, default host memory (CPU staging: PTQ moves units to the
        device one at a time; evaluation builds the layer on the compute device directly).
        ``sharded=True``: its tensors placed on their target devices as they are read.
        The caller releases it with :meth:`release_block` after use.
        """

    @abc.abstractmethod
    def do_embedding_forward(self, samples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Token samples (each ``[B, S]``) -> the inputs of layer 0, one per sample.

        Must set ``self.sample_state`` to one kwargs dict per sample (what
        :meth:`do_block_forward` passes to every layer besides the hidden state)."""

    @abc.abstractmethod
    def do_head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output for one sample -> fp32 logits ``[B, S, V]`` (every position)."""

    @abc.abstractmethod
    def iter_ptq_units(self, block: nn.Module, layer_idx: int, targets: Sequence[str]) -> Iterator[PtqUnit]:
        """The PTQ units of a quantized layer, in a deterministic order."""

    @abc.abstractmethod
    def quantize_block(self, block: nn.Module, scheme: Any, targets: Sequence[str]) -> nn.Module:
        """Wrap ``block``'s quantizable modules for ``scheme`` / ``targets`` (in place)."""

    def prepare_capture(self, block: nn.Module) -> None:
        """Make every PTQ unit of ``block`` run as its own module call, so forward hooks see
        its inputs (turn off fused paths that bypass the unit modules). Default: nothing."""

    def end_capture(self, block: nn.Module) -> None:
        """Undo :meth:`prepare_capture`: the fused paths evaluation uses are back on (the layer
        then propagates its calibration stream as it will be evaluated). Default: nothing."""

    @abc.abstractmethod
    def set_quant_enabled(self, module: nn.Module, enabled: bool) -> None:
        """Switch every quantizer inside ``module`` off (bit-identical float math) or on."""

    # ------------------------------------------------------------------ provided
    def block_device(self, block: nn.Module) -> torch.device:
        """Where a block's forward runs: the device of its first parameter (stem of a sharded
        layer), or the compute device for a parameterless block."""
        for p in block.parameters():
            return p.device
        return self.device

    @torch.no_grad()
    def do_block_forward(self, block: nn.Module, inputs: Sequence[torch.Tensor],
                         sample_state: Sequence[dict[str, Any]] | None = None,
                         progress: bool | str = False, graphed: bool = False,
                         keep_outputs: bool = True,
                         stop_after: Sequence[nn.Module] = ()) -> list[torch.Tensor]:
        """Run ``block`` over every sample; returns the outputs in input order.

        ``stop_after`` (with ``keep_outputs=False``): a sample's forward ends as soon as each of
        these sub-modules has returned once, for a forward run only for what hooks inside them
        see (sequential GPTQ's re-run of a layer for its attention's leaves need not run the
        MoE after it). Each must be called at most once per sample, as a module (its forward
        hooks fire); one that is never called just lets the sample run to its end.

        ``keep_outputs=False``: the outputs are dropped as they come (an empty list is
        returned), for a forward run only for what hooks see (a later Hessian capture pass,
        whose output would be a second host copy of the layer's: 15 GB for V4-Pro at 128 x 2048).

        ``graphed``: replay the layer from a captured CUDA graph after its first call per input
        shape (``device.GraphedForward``: same kernels, no per-kernel launch cost). Only for a
        layer that stays unchanged during the loop; the graph is dropped when it ends.

        Sample ``k`` is called as ``block(inputs[k], **sample_state[k])`` where ``sample_state``
        defaults to ``self.sample_state``. Inputs are moved to the block's device; outputs go
        back to the host when ``run.offload_hidden`` (device memory then holds one sample's
        activations, not all of them).
        """
        state = self.sample_state if sample_state is None else sample_state
        if state is None:
            state = [{}] * len(inputs)
        if len(state) != len(inputs):
            raise ValueError(f"do_block_forward: {len(inputs)} inputs but {len(state)} sample states")
        dev = self.block_device(block)
        from tqdm.auto import tqdm

        if stop_after and (keep_outputs or graphed):
            raise ValueError("do_block_forward: stop_after needs keep_outputs=False and no graph")
        call = devmod.GraphedForward(block, dev) if graphed else block
        stopper = _StopAfter(stop_after) if stop_after else contextlib.nullcontext()
        outs = []
        desc = progress if isinstance(progress, str) else "block"
        for x, kw in tqdm(list(zip(inputs, state)), desc=desc, leave=False,
                          disable=not (progress and self.run.progress)):
            kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            # the quantizers' NaN/Inf flags are read once per sample, not once per quantizer
            # (device_checks, casebook S14)
            y = None
            with device_checks.deferred_checks(), stopper:
                y = call(x.to(dev, non_blocking=True), **kw)
            if keep_outputs:
                outs.append(devmod.to_host(y) if self.run.offload_hidden else y)
            del y
        return outs

    def concat_samples(self, inputs: Sequence[torch.Tensor], states: Sequence[dict[str, Any]]
                       ) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """Several calibration samples as ONE block call (batch dim 0): ``(x, state)`` such that
        ``block(x, **state)`` is the samples' outputs concatenated, or None where the model cannot
        say (the default: its sample state is opaque here). A block-level algorithm then runs
        a step's samples in one forward (one fake-quant of the layer's weights, not one a sample)."""
        return None

    def block_forward_sample(self, block: nn.Module, x: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """One sample through ``block`` as :meth:`do_block_forward` runs it (inputs moved to the
        block's device, the quantizers' NaN/Inf flags read once), but with autograd as the caller
        has it: a block-level algorithm backpropagates through it."""
        dev = self.block_device(block)
        kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        with device_checks.deferred_checks():
            return block(x.to(dev), **kw)

    # ------------------------------------------------------------------ optional hooks (declared)
    #: the model's config object, when the adapter has read one (reports name its fields)
    config: Any = None
    #: the description of an exported (already quantized) checkpoint at ``model_path``, or None:
    #: such a checkpoint is evaluated as it is, never quantized again
    exported: Any = None
    #: the checkpoint reader (``io.checkpoint.CheckpointReader``) of an adapter that reads a
    #: safetensors checkpoint; the resume guard hashes the weights its index names
    reader: Any = None
    #: the name of the model's extra layers (``ModelBinding.extra_layers``: checkpoint keys
    #: ``{name}.{j}.*``, the report's entry); '' = none
    extra_layers: str = ""

    @property
    def max_seq_len(self) -> int | None:
        """The longest window the model's positions allow (None: no limit known)."""
        return None

    def model_id(self) -> dict[str, Any]:
        """What identifies the model in ptq_params/meta.json (a resumed run must agree on it);
        a model adapter adds its config / index hashes. Default: the checkpoint folder's name."""
        return {"name": str(self.model_path)}

    def layer_name(self, layer_id: int) -> str:
        """The checkpoint prefix of layer ``layer_id`` as reports name it (past the decoder layers:
        the model's extra layers, e.g. an MTP layer)."""
        return f"layers.{layer_id}"

    def mtp_layer_ids(self) -> list[int]:
        """Layer ids (after the decoder layers) of the model's multi-token-prediction layers that
        the checkpoint holds complete; ``block(i)`` builds them. Default: none."""
        return []

    def mtp_block_inputs(self, layer_idx: int, hidden: Sequence[torch.Tensor], states: Sequence[dict[str, Any]]
                         ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """MTP layer ``layer_idx``'s inputs and per-sample states from the last decoder layer's
        outputs ``hidden`` and the samples' states. A model that lists MTP layers in
        ``mtp_layer_ids`` overrides it; the base refuses in one line naming the model."""
        raise _no_mtp_hook(self, "mtp_block_inputs")

    def mtp_logits(self, layer_idx: int, y: torch.Tensor) -> torch.Tensor:
        """Logits of MTP layer ``layer_idx``'s output ``y`` (overridden like ``mtp_block_inputs``)."""
        raise _no_mtp_hook(self, "mtp_logits")

    def layer_cost(self, layer_idx: int, targets: Sequence[str], n_tokens: int, epochs: int) -> Any:
        """The cost of layer ``layer_idx`` (``layer_cost.LayerCost``) for the torchrun layer
        split. Default: every layer alike; a model adapter states its own cost model."""
        from .pipeline.layer_cost import LayerCost

        return LayerCost(float_s=1.0, solve_s=1.0 if targets else 0.0)

    def target_weight_count(self, layer_idx: int, target: str) -> int | None:
        """At least how many weights of layer ``layer_idx`` linear target ``target`` ('moe',
        'attn-linear', ...) quantizes, from the config alone (no weights read); None: unknown.
        A run refuses with it, before any layer, a block stage whose weights and learnable state
        alone exceed the device (``BlockStage.check_device_memory``). Default: unknown."""
        return None

    def unit_device(self, block: nn.Module, unit: PtqUnit) -> torch.device:
        """The device holding ``unit`` of ``block`` (where its solve runs when the layer is
        sharded). Default: the device of its first parameter, else the compute device."""
        for p in unit.module.parameters():
            return p.device
        return self.device

    def release_block(self, block: nn.Module) -> None:
        """Drop a layer built by :meth:`block`: remove dispatch hooks, free its memory."""
        from .runtime.dispatch import undispatch_layer

        undispatch_layer(block)
        # Moving parameters to meta frees their storage now, even if a caller still holds a
        # reference to the module (a PtqUnit, a captured closure). No gc.collect(): with the
        # storage gone there is nothing left to reclaim, and a full collection costs ~0.5 s
        # per layer once transformers is imported.
        block.to("meta")
        for d in self.shard_devices():
            devmod.empty_cache(d)

    def shard_devices(self) -> list[torch.device]:
        """Devices a sharded layer is spread over (``run.shard_devices`` or the whole backend)."""
        if self.run.shard_devices:
            return [torch.device(d) for d in self.run.shard_devices]
        if self.device.type == "cpu":
            return [self.device]
        return devmod.device_list(self.device.type)

    def tokenizer(self):
        """The checkpoint's tokenizer (``AutoTokenizer.from_pretrained(model_path)``)."""
        tok = getattr(self, "_tokenizer", None)
        if tok is not None:
            return tok
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
            return self._tokenizer
        except Exception as e:  # missing / broken tokenizer files: one line, name the file or the folder
            from .pipeline.tokenizer_files import missing_tokenizer_line

            missing = missing_tokenizer_line(self.model_path)
            if missing is not None:
                raise DataError(missing) from None
            raise DataError(f"{self.model_path}: cannot load the tokenizer "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    def close(self) -> None:
        """Release files and caches held by the adapter."""

    def __enter__(self) -> "BaseModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _SampleDone(BaseException):
    """Raised by ``_StopAfter`` inside a sample's forward; never leaves ``do_block_forward``.
    A BaseException, so a model's own ``except Exception`` fallback cannot swallow it."""


class _StopAfter:
    """Per-sample scope of ``do_block_forward(stop_after=...)``: forward hooks on the modules
    mark each one done; once all are, the sample's forward is ended by ``_SampleDone``, which the
    scope swallows (so the sample's deferred device checks, opened outside it, are still read)."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list({id(m): m for m in modules}.values())
        self.done: set[int] = set()
        self.handles: list = []

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.done.add(id(module))
        if len(self.done) == len(self.modules):
            raise _SampleDone

    def __enter__(self) -> "_StopAfter":
        self.done = set()
        self.handles = [m.register_forward_hook(self._hook) for m in self.modules]
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        for h in self.handles:
            h.remove()
        self.handles = []
        return exc_type is _SampleDone


def _no_mtp_hook(adapter, hook: str) -> Exception:
    from .errors import ModelContractError

    ids = adapter.mtp_layer_ids()
    return ModelContractError(f"{type(adapter).__name__}.{hook}: not implemented, but the model "
                              + (f"lists MTP layers {ids} (mtp_layer_ids)" if ids else "declares no MTP layer (mtp_layer_ids)"))
