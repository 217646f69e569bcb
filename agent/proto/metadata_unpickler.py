"""Reading a checkpoint's DCP ``.metadata`` without running anything it names (issue 44, item 1).

DCP writes ``.metadata`` with ``pickle.dump`` and reads it back with ``pickle.load``: whoever can write the file
chooses what the reader calls. The checkpoint directory belongs to the job's user (``<state>/checkpoint_dir`` is
theirs to write), yet root reads it through ``trainwarden checkpoints`` and ``trainwarden report``. So every
reader here unpickles with ``MetadataUnpickler``, an allow-list in the manner of torch's ``weights_only`` loader:
``find_class`` admits only the classes a DCP ``Metadata`` is made of (its dataclasses, torch's dtypes, layouts and
``Size``, plain containers) and refuses any other global with ``MetadataRefused``, which names it. Allowed classes
are only constructed (``NEWOBJ``/``REDUCE`` on a dataclass, an enum, ``torch.Size``) and given their fields
(``BUILD``): none of them runs code on its arguments.

The list was taken from real checkpoints (the reference GPT's and the test helpers', through ``pickletools``) and
torch's ``torch/distributed/checkpoint/metadata.py``; a checkpoint written by a newer torch that names a class not
listed here is reported as unreadable, naming the class, which is the cue to add it after checking it runs nothing.

``read_regular`` opens the files root reads in a job's tree with ``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link is
refused, a FIFO never blocks), checks that what it opened is a regular file, and reads at most a bound, so a file
a job's user planted can neither point root at another file nor stall or exhaust it. Nothing here imports torch:
the allowed torch modules are imported when a checkpoint names them, as ``pickle`` itself would.
"""

from __future__ import annotations

import io
import os
import pickle
import stat

__all__ = ["ALLOWED_GLOBALS", "MAX_METADATA_BYTES", "MetadataRefused", "MetadataUnpickler", "NotARegularFile",
           "load_metadata", "read_regular"]

MAX_METADATA_BYTES = 512 * 1024 * 1024
"""Largest ``.metadata`` read. Its size grows with parameters x chunks (about 300 bytes per chunk): a model of
tens of thousands of tensors sharded over thousands of ranks stays far below this."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_TORCH_DTYPES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "uint8",
                 "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool", "float8_e4m3fn",
                 "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
                 "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8", "bits16", "bits1x8", "bits2x4",
                 "bits4x2")

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("torch", name) for name in _TORCH_DTYPES),
    *(("torch", name) for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc",
                                   "_mkldnn", "jagged")),
    *(("torch", name) for name in ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
})
"""(module, name) pairs a checkpoint's metadata may name. What a real checkpoint of this torch names (the reference
GPT's and ckpt_worker's, listed with ``pickletools``): the DCP classes above, ``torch.Size``, a dtype,
``torch.serialization._get_layout`` (a layout by its name, looked up among torch's layouts) and ``pathlib.PosixPath``
(``StorageMeta.checkpoint_id``); the rest are what other DCP versions and tensors write. Deliberately absent:
anything that allocates by a number it is given (``bytes(10**12)``), ``getattr`` and every callable that is not a
plain constructor."""


class MetadataRefused(pickle.UnpicklingError):
    """The metadata names a global outside ``ALLOWED_GLOBALS``: it was not unpickled, and nothing it named ran.
    Retrying does not help; the file was not written by DCP (or by a torch whose format adds a class: check the
    class and add it to ``ALLOWED_GLOBALS``)."""

    def __init__(self, module: str, name: str) -> None:
        self.qualname = f"{module}.{name}"
        super().__init__(f"the metadata names {self.qualname}, which a checkpoint's metadata never holds; "
                         "it was not unpickled")


class NotARegularFile(OSError):
    """A file root was to read in a job's tree is a symbolic link, a FIFO, a device or a directory, or is larger
    than the bound: it is not read. Retrying does not help; the job's user put it there."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only ``ALLOWED_GLOBALS`` (see the module's docstring)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise MetadataRefused(module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("the metadata holds a persistent id, which a checkpoint's metadata never does")


def read_regular(path: str | os.PathLike, limit: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``path`` (relative to ``dir_fd`` when given), opened with ``O_NOFOLLOW | O_NONBLOCK``; raises
    ``NotARegularFile`` when it is a symbolic link or not a regular file or holds more than ``limit`` bytes,
    ``FileNotFoundError`` when absent, another ``OSError`` when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symbolic link
            raise NotARegularFile(f"{path} is a symbolic link; trainwarden reads only regular files in a "
                                  "checkpoint") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}); a checkpoint "
                                  "holds regular files only")
        if st.st_size > limit:
            raise NotARegularFile(f"{path} holds {st.st_size} bytes, more than the {limit} read at most")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise NotARegularFile(f"{path} grew past the {limit} bytes read at most while being read")
        return data
    finally:
        os.close(fd)


def load_metadata(data: bytes):
    """Unpickle a ``.metadata`` file's bytes with ``MetadataUnpickler``: raises ``MetadataRefused`` when it names a
    global outside the allow-list, another ``pickle.UnpicklingError`` (or ``EOFError``, ``ValueError``...) when
    the bytes are not a pickle, ``ImportError`` when this torch lacks an allowed module."""
    return MetadataUnpickler(io.BytesIO(data)).load()
