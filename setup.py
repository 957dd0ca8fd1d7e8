"""amct-ext: blockwise post-training quantization for DeepSeek-V4 (AMCT style)."""
from setuptools import find_packages, setup

setup(
    name="amct-ext",
    version="0.1.0",
    description="Blockwise PTQ for DeepSeek-V4 on Ascend NPUs, CUDA GPUs and CPUs",
    python_requires=">=3.10",
    packages=find_packages(include=["amct_ext", "amct_ext.*", "models", "models.*"]),
    # the data a run needs offline ships inside the packages (amct_ext/data/README.md: licence)
    package_data={
        "amct_ext.quant": ["schemes/*.json"],
        "amct_ext.data": ["README.md", "LICENSE", "wikitext-2/*", "wikitext-2-raw/*"],
        "models.deepseek_v4": ["configs/*.json", "SPEC.md"],
    },
    include_package_data=True,
    install_requires=[
        # torch: on machines with a local CPU wheel, install `torch==2.13.0` first; any
        # release >= 2.4 works.
        "torch>=2.4",
        "transformers>=5.10",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "numpy",
        "tqdm",
    ],
    extras_require={
        "npu": ["torch_npu"],
        "hub": ["modelscope"],
        "plot": ["matplotlib"],
        # --calib-dataset NAME: fetch a calibration split from the Hugging Face hub (online only)
        "datasets": ["datasets>=2.14"],
        # triton: the CUDA fast paths' kernels; the CPU tests run them under Triton's interpreter
        # compressed-tensors: the export tests' independent check (its compressors decompress our
        # exported weights, its config model parses our quantization_config)
        # pytest-xdist: the README's suite runs on two workers (one core each: 8 min instead of 13
        # on a slow 2-core host; casebook F-suite-time)
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3", "matplotlib", "triton>=3.2,<4; platform_system == 'Linux'",
                 "compressed-tensors>=0.20"],
    },
)
