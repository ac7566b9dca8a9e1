"""The wheels a lent GPU machine lacks: chosen and downloaded here, installed offline there.

The GPU machine (the device tool's ``nvidia-h100-x1``) has Python 3.12 with CUDA torch and
transformers but no network, and lacks some of Relay's runtime dependencies. ``carried``
computes what to bring: Relay's ``[project] dependencies`` and everything they require
(``Requires-Dist``, markers evaluated for the GPU machine's Python on Linux x86-64), minus
what the GPU machine already holds (``GPU_MACHINE_HAS``), each pinned to the version
installed here, the one Relay's tests run with. ``prepare`` downloads those wheels with
``pip download --no-deps`` for that Python and platform; ``install`` puts them into a folder
there with ``pip install --no-index --no-deps --target`` and ``activate`` puts that folder
on ``sys.path`` and on ``PYTHONPATH`` for child processes. Relay itself travels as a wheel
too (``relay_wheel_command``): its folders become the ``relay`` package only when installed.

MLflow comes as ``mlflow-skinny`` (``SUBSTITUTES``): the full ``mlflow`` wheel (12 MB) adds
its server and UI (Flask, gunicorn, docker, graphene...), which Relay never starts; the
tracking client and its SQLAlchemy store (the ``sqlite:`` URI a run's tracking defaults to,
``relay.learner.tracking``) are in mlflow-skinny, whose store needs ``sqlalchemy`` and
``alembic``, which full mlflow requires and skinny does not, so they are carried beside it.
Torch and CUDA packages are never carried (``NEVER_CARRIED``): the GPU machine's own are
the ones under test.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

GPU_MACHINE_HAS = frozenset(canonicalize_name(name) for name in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
    humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
    lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
    markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy
    numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
    nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
    pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
    pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
    sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
    tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split())
"""The Python distributions of the GPU machine's image ('cuda'), as the device tool's
KINDS.md lists them (read there on 2026-11-17): never carried."""

SUBSTITUTES = {"mlflow": ("mlflow-skinny", "sqlalchemy", "alembic")}
"""A requirement carried as other distributions (module docstring)."""

NEVER_CARRIED = ("torch", "triton")
NEVER_CARRIED_PREFIXES = ("nvidia-", "cuda-")
"""Distributions that must come with the GPU machine, not from here."""

GPU_PYTHON = "3.12"  # the GPU machine's python3 (3.12.3)
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)))
"""pip matches each manylinux tag exactly: every glibc from 2.17 to 2.39 (Ubuntu 24.04's,
the GPU machine's) is named, so a wheel built for any of them is found."""
MAX_TOTAL_MB = 60.0  # the device tool carries 64 MiB with the working tree


def target_environment(python_version: str = GPU_PYTHON) -> dict[str, str]:
    """PEP 508 marker values of the GPU machine: CPython ``python_version`` on Linux x86-64."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": "x86_64", "extra": ""}


def runtime_requirements(pyproject: Path, environment: dict[str, str]) -> list[str]:
    """The names in ``pyproject``'s ``[project] dependencies`` that ``environment`` needs
    (``tomli`` is for Python 3.10 only, say)."""
    with open(pyproject, "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    requirements = [Requirement(line) for line in dependencies]
    return [r.name for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def carried(roots: Iterable[str], *, environment: dict[str, str],
            version_of: Callable[[str], str] = metadata.version,
            requires_of: Callable[[str], list[str] | None] = metadata.requires,
            ) -> dict[str, str]:
    """``{distribution: version}`` to carry: ``roots`` and what they require (``SUBSTITUTES``
    applied), those of ``GPU_MACHINE_HAS`` left out, pinned to ``version_of`` each (the
    version installed here). ``RuntimeError`` naming a distribution that is not installed
    here or must never be carried."""
    todo = [canonicalize_name(name) for name in roots]
    pins: dict[str, str] = {}
    while todo:
        name = todo.pop()
        if name in SUBSTITUTES:
            todo.extend(canonicalize_name(n) for n in SUBSTITUTES[name])
            continue
        if name in GPU_MACHINE_HAS or name in pins:
            continue
        if name in NEVER_CARRIED or name.startswith(NEVER_CARRIED_PREFIXES):
            raise RuntimeError(f"{name} would be carried to the GPU machine, which must use its "
                               "own torch and CUDA packages; add it to GPU_MACHINE_HAS")
        try:
            pins[name] = version_of(name)
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"{name} is needed on the GPU machine but not installed here: "
                               "run --prepare in Relay's environment (tools/with-venv)") from None
        for line in requires_of(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(canonicalize_name(requirement.name))
    return dict(sorted(pins.items()))


def download_command(pins: dict[str, str], folder: Path,
                     python_version: str = GPU_PYTHON) -> list[str]:
    """``pip download`` of exactly ``pins``' wheels for ``python_version`` on Linux x86-64."""
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", *platforms,
            "--dest", str(folder), *(f"{name}=={version}" for name, version in pins.items())]


def wheel_versions(folder: Path) -> dict[str, str]:
    """``{distribution: version}`` of the wheels in ``folder``; ``RuntimeError`` when one
    distribution has two (an offline install refuses them)."""
    found: dict[str, str] = {}
    for wheel in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if found.get(name, str(version)) != str(version):
            raise RuntimeError(f"{folder} holds {name} {found[name]} and {version}: keep one")
        found[name] = str(version)
    return found


def prepare(folder: Path, pyproject: Path, python_version: str = GPU_PYTHON) -> float:
    """Download into ``folder`` the wheels the GPU machine lacks (module docstring), after
    removing the wheels there that are not among them; their total size in MB, which must
    stay under ``MAX_TOTAL_MB``."""
    environment = target_environment(python_version)
    pins = carried(runtime_requirements(pyproject, environment), environment=environment)
    expected = {name: str(Version(version)) for name, version in pins.items()}
    folder.mkdir(parents=True, exist_ok=True)
    for wheel in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if expected.get(name) != str(version):
            wheel.unlink()
    subprocess.run(download_command(pins, folder, python_version), check=True)
    got = wheel_versions(folder)
    if got != expected:
        raise RuntimeError(f"{folder} holds {got}, expected {expected}")
    subprocess.run(relay_wheel_command(pyproject.parent, folder), check=True)
    total_mb = sum(w.stat().st_size for w in folder.glob("*.whl")) / 1e6
    if total_mb > MAX_TOTAL_MB:
        raise RuntimeError(f"the wheels take {total_mb:.1f} MB, over {MAX_TOTAL_MB:g} MB")
    return total_mb


def relay_wheel_command(root: Path, folder: Path) -> list[str]:
    """Relay's own wheel (pure Python, for any machine) from the checkout at ``root`` into
    ``folder``, where ``prepare`` has just removed any older one (it is not among the pins)."""
    return [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
            str(folder), str(root)]


def install_command(wheels: list[Path], target: Path) -> list[str]:
    """The offline install of ``wheels``, without their dependencies, into ``target``."""
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
            *map(str, wheels)]


def install(folder: Path, target: Path) -> list[str]:
    """Install every wheel of ``folder`` into ``target`` (nothing when it holds none); the
    names of the wheels installed."""
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        wheel_versions(folder)  # one version each, or a clear error before pip's
        subprocess.run(install_command(wheels, target), check=True)
    return [w.name for w in wheels]


def activate(paths: list[Path]) -> None:
    """Put ``paths`` first on this process's ``sys.path`` and on ``PYTHONPATH`` for its
    children, in order."""
    for path in reversed(paths):
        sys.path.insert(0, str(path))
    importlib.invalidate_caches()
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *inherited])
