"""areal-mega: asynchronous RL for LLMs on Megatron-Core.

`pip install --no-build-isolation -e .` (what `make test` runs) or
`python setup.py build_ext --inplace` builds the csrc kernels next to the package:

* ``areal_mega._ops_cpu``  -- C++ CPU kernels (always; needs torch and a C++17 compiler);
* ``areal_mega._ops_cuda`` -- CUDA kernels (only when torch has CUDA and nvcc is found;
  ``AREAL_MEGA_NO_CUDA=1`` skips it, ``TORCH_CUDA_ARCH_LIST`` picks the architectures).
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CSRC = "csrc"


def read_requirements():
    reqs = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith(("pytest", "ninja", "pybind11")):
            reqs.append(line)
    return reqs


def kernel_extensions():
    """The csrc extension modules (empty, with a message, when torch is not importable)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("areal-mega: torch not importable, skipping the csrc kernels", file=sys.stderr)
        return [], {}
    include = [str(ROOT / CSRC / "include"), str(ROOT / CSRC / "bindings")]
    cxx = ["-O3", "-std=c++20", "-Wno-psabi"]
    exts = [cpp_extension.CppExtension(
        "areal_mega._ops_cpu",
        sources=[f"{CSRC}/bindings/ops_cpu.cpp", f"{CSRC}/logprob/logprob_cpu.cpp",
                 f"{CSRC}/gae/gae_cpu.cpp"],
        include_dirs=include, extra_compile_args={"cxx": cxx})]
    nvcc = cpp_extension.CUDA_HOME and shutil.which("nvcc", path=os.path.join(
        cpp_extension.CUDA_HOME, "bin"))
    if torch.version.cuda and nvcc and os.environ.get("AREAL_MEGA_NO_CUDA") != "1":
        exts.append(cpp_extension.CUDAExtension(
            "areal_mega._ops_cuda",
            sources=[f"{CSRC}/bindings/ops_cuda.cpp", f"{CSRC}/logprob/logprob_cuda.cu",
                     f"{CSRC}/gae/gae_cuda.cu"],
            include_dirs=include,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17"]}))
    else:
        print("areal-mega: building CPU kernels only (torch.version.cuda="
              f"{torch.version.cuda}, nvcc={nvcc})", file=sys.stderr)
    return exts, {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = kernel_extensions()

setup(
    name="areal-mega",
    version="0.1.0",
    description="Megatron-Core based asynchronous reinforcement learning for large language models",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["areal_mega", "areal_mega.*"]),
    python_requires=">=3.10",
    install_requires=read_requirements(),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang[all]"],
        "test": ["pytest==9.2.0", "pytest-timeout==2.4.0"],
    },
)
