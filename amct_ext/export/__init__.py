"""Deployable export of quantized checkpoints (issue 14).

- ``exporter``: the streamed, per-layer export (``ExportConfig`` / ``export_checkpoint``);
- ``compressed_tensors``: the compressed-tensors layout and ``quantization_config`` (vLLM);
- ``ascend``: the Ascend ModelSlim v1 layout and ``quant_model_description.json`` (vllm-ascend);
- ``writer``: resumable sharded safetensors output, index written last;
- ``readback``: decoding exported weights and their declared activation quantization.

The bit packing both layouts use is ``amct_ext.quant.packing``.

Kept import-free: ``amct_ext.io.checkpoint`` imports ``readback`` and must not pull in the workflow.
"""
