"""Fake quantization: number formats, quantizers, QuantLinear and friends, schemes (the built-in
scheme files live in schemes/*.json beside schemes.py)."""
