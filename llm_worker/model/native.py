"""The fast forward's fused CPU kernels (``csrc/``, one source file per operation), compiled once
per machine.

Between its GEMMs, a decode step of the fast forward used to run some 25 small torch operations
per layer (RMSNorm, RoPE, the cache writes, attention's batched GEMMs, softmax, SiLU, residuals),
each a few microseconds of dispatch on a row of a few hundred numbers: on a 2-core Xeon about
19 ms of a 43 ms step, against 24 ms of GEMMs. The kernels here do that work in four calls per
layer, each row-invariant by construction (see ``csrc/kernels.h``): residual add + RMSNorm,
SiLU·up, RoPE + the KV cache write, and softmax attention over the visible cached keys (one fixed
order per query row: no chunk grid, no padding).

They need an x86-64 processor with AVX2 and FMA, and a C++ compiler the first time
(``torch.utils.cpp_extension`` with ninja): the build (about 30 s) lands in
``$SPECDRAFT_NATIVE_DIR`` (default ``cache_root()/native``) under a name made of the digest of
every source and header, the flags and the torch version, so a stale build is never loaded;
processes starting together take turns. A directory built in advance (``main``, as ``make setup``
and the container images do) is loaded without a compiler and without writing. Where the processor
or the compiler is missing, ``load()`` returns None and the forward uses its torch-operation
path.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from specdraft.common import Progress, file_lock, native_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
"""The translation units the module is built from (``csrc/kernels.h`` lists what each holds)."""
HEADERS = tuple(sorted(CSRC.glob("*.h")))
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
"""-ffp-contract=off: only the FMAs the source writes are fused (the compiler must not contract
others differently in a loop's body and its tail); -fopenmp: beside their own thread pool, the
kernels can share rows on torch's OpenMP threads (``use_pool``), the process's one OpenMP
runtime, the one torch loaded."""

_loaded: dict[str, ModuleType | None] = {}
_active: ModuleType | None = None  # the kernels ``load`` loaded last (``loaded``)


def unavailable_reason(build: bool = True) -> str | None:
    """Why the native kernels cannot run here (None if they can); ``build``: whether they still
    have to be compiled."""
    if os.environ.get("SPECDRAFT_NATIVE", "1") == "0":
        return "turned off by SPECDRAFT_NATIVE=0"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the processor lacks AVX2/FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if not build:
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    try:
        import ninja  # noqa: F401  (cpp_extension builds with it)
    except ImportError:
        return "the ninja package is missing"
    return None


def build_name(sources: tuple[Path, ...] = SOURCES + HEADERS) -> str:
    """The build's name: a digest of ``sources`` (every file that goes into it, by name and
    content), the flags and the torch version."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(CFLAGS).encode() + torch.__version__.encode())
    return f"specdraft_fused_{digest.hexdigest()[:12]}"


def _import(name: str, library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The compiled kernels (built on first use), or None where they cannot run (logged)."""
    name = build_name()
    if name in _loaded:
        return _loaded[name]
    module: ModuleType | None = None
    directory = native_dir() / name
    library = directory / f"{name}.so"
    # A build in advance in a directory this process may not write (a container's) is imported
    # as it is; elsewhere the build runs under the lock (a no-op when it is up to date), so that
    # a library another process is still linking is never opened.
    prebuilt = library.is_file() and not os.access(native_dir(), os.W_OK)
    reason = unavailable_reason(build=not prebuilt)
    if reason is None:
        try:
            module = _import(name, library) if prebuilt else _build(name, directory, SOURCES)
        except (OSError, RuntimeError, ImportError) as exc:
            text = str(exc).strip()
            reason = f"the build failed: {text.splitlines()[-1] if text else type(exc).__name__}"
    if reason is not None:
        log.warning("fused CPU kernels unavailable (%s): the fast forward uses torch operations", reason)
    else:
        assert module is not None
        module.configure(torch.get_num_threads())  # torch's intra-op threads, as set at load
        global _active
        _active = module
    _loaded[name] = module
    return module


def loaded() -> ModuleType | None:
    """The kernels if this process has loaded them (``load``), else None: never builds, so a
    per-step caller (``llm_worker.logits``) costs nothing where they are not in use."""
    return _active


def describe() -> str:
    """Whether the kernels can run here, without building them (``specdraft --version``):
    ``"yes (built in DIR)"``, ``"yes (compiled on first use, about 30 s)"`` or ``"no: REASON"``."""
    name = build_name()
    library = native_dir() / name / f"{name}.so"
    reason = unavailable_reason(build=not library.is_file())
    if reason is not None:
        return f"no: {reason}"
    if not library.is_file():
        return "yes (compiled on first use, about 30 s)"
    return f"yes (built in {library.parent})"


@contextmanager
def serial_torch(on: bool = True) -> Iterator[None]:
    """torch's own operations run on the calling thread alone inside (``on``); the fused
    kernels' pool keeps its threads.

    A forward whose GEMMs all run on the pool still makes a few dozen small torch operations
    (the embedding, indexing, masks, copies). torch opens an OpenMP parallel region for many of
    them however small; the region wakes torch's worker threads, which then spin for a while and
    take a core from the pool's worker. On a 2-core EPYC that made a 2-row forward cost 1.9
    single-row ones instead of 1.2 (one GEMM now and then waited milliseconds for its second
    thread). ``torch.set_num_threads`` is process-wide, so callers hold the scope only while
    they run the model (the target's forward keeps one caller at a time)."""
    threads = torch.get_num_threads()
    if not on or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


BUILD_SECONDS = 40.0
"""About how long the first build takes on 2 cores (the estimate its progress lines start from)."""


def _build(name: str, directory: Path, sources: tuple[Path, ...]) -> ModuleType:
    """Compile (or, when up to date, only load) the kernels; a first build writes progress
    lines (``specdraft.common.Progress``), a later one is silent."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    first = not (directory / f"{name}.so").is_file()
    with file_lock(directory.with_name(name + ".lock")), _compiling(first):
        # torch's own build lock (a file it deletes when done): one left by a build that was
        # killed makes every later build wait for it forever. Under our lock no other process
        # of ours is building here, so such a file is stale.
        (directory / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )


@contextmanager
def _compiling(first: bool) -> Iterator[None]:
    if not first:
        yield
        return
    progress = Progress("compiling the fused CPU kernels for this processor", BUILD_SECONDS)
    with progress.ticking():
        yield


def main() -> int:
    """Build the kernels now (``make setup``, container images): prints their directory, or why
    they cannot be built here (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load() is None:
        print(f"fused CPU kernels not built: {unavailable_reason()}", file=sys.stderr)
        return 1
    print(native_dir() / build_name())
    return 0
