"""Compile the verifier's C kernels for the machine they run on, once, into a per-user cache.

Each kernel is built with the system C compiler and -march=native, so the binary is keyed by the
sources (and the headers beside them), the flags, the compiler's version and the CPU; a cached
build is reused, a missing one is compiled beside its final name and renamed, so processes
starting together never load half a file.
`build` returns None when there is no compiler or the build fails; callers then use torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


@functools.cache  # one compile check per process and kernel, however many models load it
def build(sources: tuple[Path, ...], flags: tuple[str, ...], cache_dir: Path | None = None,
          compiler: str = "cc") -> Path | None:
    """The shared library of `sources` (linked together) built with `flags`, compiled now unless cached."""
    source = sources[0]  # names the library and the log lines
    path = shutil.which(compiler)
    if path is None:
        log.warning("no C compiler (%s) on PATH: %s is not built, the verifier uses torch kernels (slower)",
                    compiler, source.name)
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    # Headers beside the sources (#include "...") are part of what gets built.
    texts = [path.read_text() for path in (*sources, *sorted(source.parent.glob("*.h")))]
    key = hashlib.sha256("\0".join([*texts, version, _cpu_signature(), *flags]).encode()).hexdigest()[:16]
    cache_dir = cache_dir or Path.home() / ".cache" / "pardec"
    library = cache_dir / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(handle)
    result = subprocess.run([path, *flags, "-o", partial, *map(str, sources), "-lm"], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(partial)
        log.warning("building %s failed, the verifier uses torch kernels (slower):\n%s", source.name, result.stderr)
        return None
    os.replace(partial, library)
    return library
