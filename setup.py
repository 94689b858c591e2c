"""Sangam: a serving engine for diffusion language models (LLaDA, Dream)."""

from setuptools import Extension, find_packages, setup

# The C++ host-side hot path (csrc/). optional=True: where no compiler works the build only
# warns and sangam runs on its pure-Python fallback (sangam/engine/host_batch.py).
HOST_EXT = Extension(
    "sangam._host",
    sources=["csrc/host_batch.cpp"],
    depends=["csrc/noise.h", "csrc/rules.h"],
    language="c++",
    optional=True,
)

setup(
    name="sangam",
    version="0.1.0",
    description="Serving engine for diffusion LLMs: continuous batching, paged KV, "
    "deficit token-budget scheduling, Triton kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["sangam", "sangam.*"]),
    package_data={"sangam.demo": ["model/*", "model_long/*", "model_gemma/*"]},
    ext_modules=[HOST_EXT],
    install_requires=[
        "torch>=2.5",  # scaled_dot_product_attention(enable_gqa=...)
        "triton>=3.2",
        "numpy",
        "safetensors",
        "transformers>=4.44",
        "tokenizers",
        "jinja2",
        "fastapi",
        "uvicorn[standard]",  # uvloop and httptools: a faster event loop and HTTP parser
        "prometheus-client",
        "httpx",
        "pyzmq",
        "matplotlib",
        "tqdm",
        "llguidance>=1.9",  # structured output: grammars, JSON schemas and token masks
    ],
    extras_require={
        "dev": ["pytest", "pytest-benchmark", "ruff", "hypothesis", "openai", "httpx",
                "schemathesis", "jsonschema", "ray",  # ray: the Ray backend's tests
                "compressed-tensors"],  # writes the FP8 test checkpoints in its own format
    },
    entry_points={
        "console_scripts": [
            "sangam-bench=sangam.bench.cli:main",
            "sangam=sangam.cli:main",
        ],
    },
)
