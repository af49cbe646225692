"""areal-mega: asynchronous RL for LLMs on Megatron-Core.

`pip install --no-build-isolation -e .` (what `make test` runs) or
`python setup.py build_ext --inplace` builds the csrc kernels next to the package:

* ``areal_mega._ops_cpu``  -- C++ CPU kernels (always; needs torch and a C++17 compiler);
* ``areal_mega._ops_cuda`` -- CUDA kernels (only when torch has CUDA and nvcc is found;
  ``AREAL_MEGA_NO_CUDA=1`` skips it, ``TORCH_CUDA_ARCH_LIST`` picks the architectures and
  defaults to ``8.0;9.0+PTX`` when no GPU is visible, e.g. on a build node).

The kernels are compiled against the torch that will run them, so the build needs torch (and
numpy) importable: a plain ``pip install -e .`` builds in an isolated environment that has
neither, and this script then stops with instructions instead of installing a package whose
kernels silently fall back to the much slower pure-torch code. ``AREAL_MEGA_SKIP_KERNELS=1``
installs without kernels on purpose (with a loud notice).
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CSRC = "csrc"
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"  # A100 and H100/H200 (+PTX: newer GPUs JIT it)
SKIP_ENV = "AREAL_MEGA_SKIP_KERNELS"
TE_PIN = "transformer-engine[pytorch,{core}]==2.11.0"
NO_BUILD_DEPS_MSG = """
areal-mega: cannot build the csrc kernels: {missing} not importable in this build environment
({python}).

A plain `pip install -e .` builds in an isolated environment without torch/numpy. The kernels
must be compiled against the torch that runs them, so install torch first and build without
isolation:

    pip install -r requirements.txt          # or your CUDA torch, then the rest
    pip install --no-build-isolation -e .    # (`make install` does both)

To install WITHOUT the kernels on purpose (everything falls back to the much slower pure-torch
code), set {skip}=1.
"""


OPTIONAL_TRACKERS = ("wandb", "mlflow")  # extras (logging.trackers); pinned for the tests
OPTIONAL_LAUNCHERS = ("ray",)  # extra (launch.ray); pinned for the tests


def read_requirements():
    reqs = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith(
            ("pytest", "ninja", "pybind11", *OPTIONAL_TRACKERS, *OPTIONAL_LAUNCHERS)
        ):
            reqs.append(line)
    return reqs


def _pin(name):
    """``name==version`` as pinned in requirements.txt."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.split("#", 1)[0].strip().startswith(name + "=="):
            return line.split("#", 1)[0].strip()
    raise SystemExit(f"setup.py: {name} is not pinned in requirements.txt")


def _importable(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def check_build_deps(have_torch, have_numpy, env):
    """Stop the build (``SystemExit`` with install instructions) when torch or numpy is missing,
    unless ``AREAL_MEGA_SKIP_KERNELS=1`` is in ``env``; then return the notice to print."""
    missing = [n for n, ok in (("torch", have_torch), ("numpy", have_numpy)) if not ok]
    if not missing:
        return None
    if env.get(SKIP_ENV) != "1":
        raise SystemExit(
            NO_BUILD_DEPS_MSG.format(
                missing=" and ".join(missing), python=sys.executable, skip=SKIP_ENV
            )
        )
    return (
        f"\n{'!' * 78}\nareal-mega: {SKIP_ENV}=1 and {' and '.join(missing)} not "
        "importable: installing WITHOUT the csrc kernels; areal_mega.ops will use the "
        f"pure-torch fallback (much slower).\n{'!' * 78}\n"
    )


def cuda_arch_list(env, visible_capabilities):
    """The ``TORCH_CUDA_ARCH_LIST`` to build with, or ``None`` to leave torch's choice alone.

    ``env``: the environment; ``visible_capabilities``: ``(major, minor)`` of each visible GPU.
    An explicit ``TORCH_CUDA_ARCH_LIST`` wins; with GPUs visible torch builds for them; with
    none visible (a build node) torch's ``cpp_extension`` fails with an IndexError, so the
    default ``8.0;9.0+PTX`` is used."""
    explicit = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if explicit:
        return explicit
    if visible_capabilities:
        return None
    return DEFAULT_CUDA_ARCH_LIST


def _visible_capabilities(torch):
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.cuda.get_device_capability(i) for i in range(n)]
    except RuntimeError:  # driver present but unusable: treat as no visible GPU
        return []


def cuda_home(env, nvcc, has_headers):
    """The CUDA toolkit root to build with, or ``None``.

    ``env``: the environment; ``nvcc``: the ``nvcc`` found on ``PATH`` (or None);
    ``has_headers(root)``: whether ``root/include/cuda_runtime_api.h`` exists. An explicit
    ``CUDA_HOME`` / ``CUDA_PATH`` wins. torch guesses the parent of ``nvcc``'s directory, which is
    wrong where ``nvcc`` is a link or wrapper script outside the toolkit (``/usr/local/bin/nvcc``
    guesses ``/usr/local``, with no CUDA headers): the first of that guess, the resolved
    ``nvcc``'s toolkit and ``/usr/local/cuda`` that has the headers is used."""
    explicit = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if explicit:
        return explicit
    candidates = []
    if nvcc:
        candidates += [
            os.path.dirname(os.path.dirname(nvcc)),
            os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
        ]
    candidates.append("/usr/local/cuda")
    return next((c for c in candidates if has_headers(c)), None)


def _has_cuda_headers(root):
    return os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h"))


# at::parallel_for is an OpenMP pragma in ATen's headers: without -fopenmp the CPU kernels'
# row loops run on one thread whatever torch.set_num_threads says. Linking libgomp.so.1 binds
# to the copy torch already loaded (same soname).
OPENMP = ["-fopenmp"]


def kernel_extensions():
    """The csrc extension modules (empty when torch is missing and skipping was asked for)."""
    if not _importable("torch"):
        return [], {}
    import torch

    home = cuda_home(os.environ, shutil.which("nvcc"), _has_cuda_headers)
    if home:  # read by cpp_extension when imported; set on it too in case it already was
        os.environ["CUDA_HOME"] = home
    from torch.utils import cpp_extension

    if home:
        cpp_extension.CUDA_HOME = home
    include = [str(ROOT / CSRC / "include"), str(ROOT / CSRC / "bindings")]
    cxx = ["-O3", "-std=c++20", "-Wno-psabi"]
    exts = [
        cpp_extension.CppExtension(
            "areal_mega._ops_cpu",
            sources=[
                f"{CSRC}/bindings/ops_cpu.cpp",
                f"{CSRC}/logprob/logprob_cpu.cpp",
                f"{CSRC}/logprob/logprob_cpu_avx512.cpp",
                f"{CSRC}/logprob/logprob_cpu_avx2.cpp",
                f"{CSRC}/logprob/logprob_cpu_generic.cpp",
                f"{CSRC}/gae/gae_cpu.cpp",
                f"{CSRC}/bindings/decode_ops_cpu.cpp",
                f"{CSRC}/bindings/wgrad_ops_cpu.cpp",
                f"{CSRC}/decode/decode_cpu.cpp",
                *(f"{CSRC}/decode/decode_cpu_{isa}.cpp" for isa in ("avx512", "avx2", "generic")),
            ],
            include_dirs=include,
            extra_compile_args={"cxx": cxx + OPENMP},
            extra_link_args=OPENMP,
        )
    ]
    nvcc = cpp_extension.CUDA_HOME and shutil.which(
        "nvcc", path=os.path.join(cpp_extension.CUDA_HOME, "bin")
    )
    if torch.version.cuda and nvcc and os.environ.get("AREAL_MEGA_NO_CUDA") != "1":
        arch = cuda_arch_list(os.environ, _visible_capabilities(torch))
        if arch and arch != os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
            print(
                f"areal-mega: no GPU visible; building the CUDA kernels for "
                f"TORCH_CUDA_ARCH_LIST={arch} (set it to choose others)",
                file=sys.stderr,
            )
        exts.append(
            cpp_extension.CUDAExtension(
                "areal_mega._ops_cuda",
                sources=[
                    f"{CSRC}/bindings/ops_cuda.cpp",
                    f"{CSRC}/logprob/logprob_cuda.cu",
                    f"{CSRC}/gae/gae_cuda.cu",
                ],
                include_dirs=include,
                extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17"]},
            )
        )
    else:
        print(
            "areal-mega: building CPU kernels only (torch.version.cuda="
            f"{torch.version.cuda}, nvcc={nvcc})",
            file=sys.stderr,
        )
    return exts, {"build_ext": cpp_extension.BuildExtension}


def main():
    """Check the build dependencies, then run setuptools."""
    notice = check_build_deps(_importable("torch"), _importable("numpy"), os.environ)
    if notice:
        print(notice, file=sys.stderr)
    ext_modules, cmdclass = kernel_extensions()
    setup(
        name="areal-mega",
        version="0.1.0",
        description=(
            "Megatron-Core based asynchronous reinforcement learning for large language models"
        ),
        long_description=(ROOT / "README.md").read_text(),
        long_description_content_type="text/markdown",
        packages=find_packages(include=["areal_mega", "areal_mega.*"]),
        # Megatron-Bridge's name tables, read by checkpoint/hf_mapping.py
        package_data={"areal_mega.checkpoint": ["bridge_tables.json"]},
        python_requires=">=3.12",
        install_requires=read_requirements(),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        extras_require={
            # megatron-core 0.19.2 declares transformer-engine[core_cu13,pytorch] without a
            # version (its `te` extra); the pin stays the release measured on GPU.
            # transformer-engine-torch is a source distribution built against the installed
            # torch: install with --no-build-isolation (README, GPU).
            "gpu": [TE_PIN.format(core="core_cu13")],
            "gpu-cu12": [TE_PIN.format(core="core_cu12")],
            "sglang": ["sglang[all]"],
            # logging.trackers; the same pins as requirements.txt (what the tests install)
            "wandb": [_pin("wandb")],
            "mlflow": [_pin("mlflow-skinny")],
            # launch.ray: places and starts the run's processes on a Ray cluster
            "ray": [_pin("ray[default]")],
            "test": ["pytest==9.2.0", "pytest-timeout==2.4.0"],
        },
    )


if __name__ == "__main__":  # also true under pip (setuptools runs this file as __main__)
    main()
