"""areal-mega: asynchronous RL for LLMs on Megatron-Core.

`pip install -e .` installs the package; the csrc kernels are built by csrc/build.py when present.
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_requirements():
    reqs = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith(("pytest", "ninja", "pybind11")):
            reqs.append(line)
    return reqs


setup(
    name="areal-mega",
    version="0.1.0",
    description="Megatron-Core based asynchronous reinforcement learning for large language models",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["areal_mega", "areal_mega.*"]),
    python_requires=">=3.10",
    install_requires=read_requirements(),
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang[all]"],
        "test": ["pytest==9.2.0", "pytest-timeout==2.4.0"],
    },
)
