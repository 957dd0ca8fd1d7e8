"""How tensors and modules meet the hardware: device selection (device.py is the one module
that touches the accelerator modules), deferred NaN / Inf checks, Triton support and kernels,
fp32-island GEMMs, empty (meta) construction, per-layer device dispatch. Knows nothing about
quantization."""
