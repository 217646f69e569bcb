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

The bytes come from ``regular_file.read_regular`` (no link followed, no FIFO blocking, bounded). Nothing here
imports torch: the allowed torch modules are imported when a checkpoint names them, as ``pickle`` itself would.
"""

from __future__ import annotations

import io
import pickle

__all__ = ["ALLOWED_GLOBALS", "MAX_METADATA_BYTES", "MetadataRefused", "MetadataUnpickler", "load_metadata"]

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


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only ``ALLOWED_GLOBALS`` (see the module's docstring)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise MetadataRefused(module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("the metadata holds a persistent id, which a checkpoint's metadata never does")


def load_metadata(data: bytes):
    """Unpickle a ``.metadata`` file's bytes with ``MetadataUnpickler``: raises ``MetadataRefused`` when it names a
    global outside the allow-list, another ``pickle.UnpicklingError`` (or ``EOFError``, ``ValueError``...) when
    the bytes are not a pickle, ``ImportError`` when this torch lacks an allowed module."""
    return MetadataUnpickler(io.BytesIO(data)).load()
