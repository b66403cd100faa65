"""The prepared-weight cache: a float checkpoint's W8A8 preparation (rotation, smoothing, GPTQ:
precondition.py) saved once, so that a restart, or a second replica, loads it instead of
preparing again.

An entry is one safetensors file (no pickle) named by a key over everything that decides its
bits: the checkpoint (cheaply: each file's size and modification time and a hash of its head, its
tail and samples between, never a full read of a large file), the preparation's settings, the
source of the code that prepares and of the model it calibrates with, pardec's and torch's
versions. Its tensors are on the CPU, device-neutral. It is written to a temporary file and
renamed into place, under a lock that replicas starting together share, so one prepares and the
others wait and read; a checksum of each tensor, stored in its header and checked as the tensor
is read, catches a corrupt or partial entry, which is then prepared again and replaced. A start
reads the entry a tensor at a time as the model is built, so host memory never holds the entry
and the model side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Callable
from collections.abc import Mapping

import torch

from pardec.verifier.model.lazy_tensors import LazyTensors

log = logging.getLogger(__name__)

FORMAT = 2
SAMPLE_BYTES = 1 << 16
SAMPLES = 16
# Where the code that decides the prepared bits lives, relative to pardec's verifier package
# (folders, or files; "../" reaches the other packages of pardec).
PREPARING_CODE = ("prepare", "model", "kernels", "loading.py", "../runtime/architectures.py")
# Libraries whose versions can change prepared bits: reading, dequantizing, tokenizing the
# calibration text (its chat template), the arithmetic.
PREPARING_LIBRARIES = ("pardec", "gguf", "safetensors", "tokenizers", "jinja2", "numpy")


def default_directory(environ: dict | None = None) -> Path:
    """$XDG_CACHE_HOME/pardec, else ~/.cache/pardec (read when called, never at import)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pardec"


def checkpoint_fingerprint(path: str) -> str:
    """A checkpoint's identity from its files' sizes, modification times and sampled contents."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(file, "rb") as handle:
            for offset in _sample_offsets(stat.st_size):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    if size <= SAMPLE_BYTES * SAMPLES:
        return [0] if size <= SAMPLE_BYTES else list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return sorted({last * i // (SAMPLES - 1) for i in range(SAMPLES)})


def code_fingerprint(rooms: tuple[str, ...] = PREPARING_CODE, package: Path | None = None) -> str:
    """The source of the verifier code that decides prepared weights (or, given `rooms`, other
    results kept between starts), with pardec's and torch's versions: a change to any of them
    misses every entry made before it."""
    from importlib import metadata

    package = package or Path(__file__).resolve().parents[1]  # the verifier's
    digest = hashlib.sha256(f"{FORMAT}\0{torch.__version__}\0".encode())
    for library in PREPARING_LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{library} {metadata.version(library)}\0".encode())
    for room in rooms:
        place = package / room
        for source in [place] if place.is_file() else sorted(place.rglob("*")):
            if source.suffix in (".py", ".c", ".h"):
                digest.update(room.encode() + b"\0" + str(source.relative_to(place.parent)).encode() + b"\0")
                digest.update(source.read_bytes())
    return digest.hexdigest()


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """A checksum of one tensor: its name, dtype, shape and bytes."""
    tensor = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
    digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b"")
    return digest.hexdigest()


class PreparedCache:
    """Entries under `directory`; `prepared(key, prepare)` returns the entry, making it once."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    @staticmethod
    def key(checkpoint: str, settings: dict) -> str:
        document = json.dumps({"checkpoint": checkpoint, "settings": settings, "code": code_fingerprint()},
                              sort_keys=True)
        return hashlib.sha256(document.encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def prepared(self, key: str, prepare: Callable[[], dict[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
        """The entry's tensors, each read when the model asks for it and checked against its
        checksum then (CorruptEntry if it fails: `discard` the entry and ask again), or, with no
        readable entry, prepare()'s, kept for the next start. A cache directory that cannot be
        made or locked (read-only, not a directory) costs a preparation, nothing more."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(self.directory / f"{key}.lock", "a+")  # noqa: SIM115 -- closed below
        except OSError as error:
            log.warning("prepared-weight cache: %s unusable (%s); preparing without it", self.directory, error)
            return prepare()
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            entry = self._open(key)
            if entry is None:
                tensors = prepare()
                self._write(key, tensors)
                return tensors
            return entry

    def discard(self, key: str, damaged: CorruptEntry) -> None:
        """Removes the damaged entry `damaged` was raised for, unless another process has already
        replaced it with a good one (the next `prepared` prepares it again)."""
        with open(self.directory / f"{key}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.path(key)
            with contextlib.suppress(FileNotFoundError):
                if _identity(os.stat(path)) == damaged.identity:
                    path.unlink()

    def _open(self, key: str) -> LazyTensors | None:
        path = self.path(key)
        if not path.exists():
            return None
        try:
            entry = open_entry(path)
        except Exception as error:  # a partial or corrupt file: any failure to read its header
            log.warning("prepared-weight cache: %s unreadable (%s); preparing again", path, error)
            return None
        log.info("prepared weights read from %s", path)
        return entry

    def _write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.path(key)
        # safetensors refuses tensors that share memory: a view of a larger tensor is copied.
        stored = {}
        for name, tensor in tensors.items():
            tensor = tensor.detach().cpu().contiguous()
            shares = tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
            stored[name] = tensor.clone() if shares else tensor
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            checksums = {name: tensor_digest(name, tensor) for name, tensor in stored.items()}
            save_file(stored, str(temporary), metadata={"checksums": json.dumps(checksums), "format": str(FORMAT)})
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except Exception as error:  # a full or read-only disk (or a tensor safetensors refuses) costs the next start a preparation
            log.warning("prepared-weight cache: could not write %s (%s)", path, error)
            temporary.unlink(missing_ok=True)
            return
        log.info("prepared weights saved to %s", path)


_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
           "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


class CorruptEntry(ValueError):
    """A cache entry whose tensor failed its checks as it was read; `identity` tells the file
    (device and inode) it was read from."""

    def __init__(self, message: str, identity: tuple[int, int]):
        super().__init__(message)
        self.identity = identity


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def open_entry(path: Path) -> LazyTensors:
    """An entry's tensors, each read from the file when asked for, straight into memory of its
    own (no memory map: its touched pages would count as the process's memory next to the model
    built from them), and checked against its checksum. The file stays open for the reads, so an
    entry replaced meanwhile is never read half old, half new. The layout is safetensors': an
    8-byte little-endian header length, a JSON header of name -> dtype, shape and data offsets,
    then the data. A header that does not parse, another format, a tensor whose offsets do not
    fit its dtype and shape, or data past the file's end (a partial entry) fails here."""
    file = open(path, "rb")  # closed with the mapping that reads from it
    try:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
        metadata = header.pop("__metadata__", None) or {}
        if metadata.get("format") != str(FORMAT):
            raise ValueError(f"format {metadata.get('format')!r}, not {FORMAT}")
        checksums = json.loads(metadata["checksums"])
        stat = os.fstat(file.fileno())
        start = 8 + length
        if set(checksums) != set(header):
            raise ValueError("tensors without checksums")
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            count = math.prod(entry["shape"])
            if not 0 <= begin <= end or end - begin != count * _DTYPES[entry["dtype"]].itemsize:
                raise ValueError(f"{name}: offsets do not fit its dtype and shape")
            if start + end > stat.st_size:
                raise ValueError("cut short")
    except Exception:
        file.close()
        raise
    identity = _identity(stat)

    def load(name: str) -> torch.Tensor:
        entry = header[name]
        begin, end = entry["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        try:
            if end > begin and os.preadv(file.fileno(), [memoryview(raw.numpy())], start + begin) != end - begin:
                raise ValueError("runs past the end of the file")
            tensor = raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        except (OSError, ValueError, RuntimeError) as error:
            raise CorruptEntry(f"{path}: {name}: {error}", identity) from None
        if tensor_digest(name, tensor) != checksums[name]:
            raise CorruptEntry(f"{path}: {name} fails its checksum", identity)
        return tensor

    return LazyTensors({name: tuple(entry["shape"]) for name, entry in header.items()}, load)
