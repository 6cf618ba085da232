"""A GGUF file's metadata, read as an untrusted file: only a regular file is opened (a FIFO, a device or a
directory named *.gguf is refused before any read can block), every count and length is checked against the bytes
left before anything is read or allocated, arrays are skipped without being built, and no more than
MAX_METADATA_BYTES are read. Only the scalar values a caller asks for are kept.

The format (ggml's docs/gguf.md, versions 2 and 3, little-endian): "GGUF", a u32 version, a u64 tensor count, a
u64 key-value count, then each key-value: a string key (u64 length, bytes), a u32 type and the value; an array is
a u32 element type, a u64 count and the elements.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from typing import BinaryIO

MAGIC = b"GGUF"
MAX_METADATA_BYTES = 32 << 20  # far more than any real model's key-values (a 256k-token vocabulary is ~10 MiB)
MAX_KEY_BYTES = 1 << 16
STRING, ARRAY = 8, 9
CHUNK = 1 << 16
_SCALARS = {t: struct.Struct(f) for t, f in
            {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}.items()}

Value = int | float | bool | str


class NotGGUF(ValueError):
    """The file is not a GGUF file this reader accepts (its reason says where it went wrong)."""


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """The file opened for reading if it is a regular file (symbolic links followed); an OSError otherwise. Opened
    non-blocking, so that a FIFO cannot hold the open, and checked on the descriptor, so that nothing can be swapped
    in between the check and the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.fspath(path)}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_metadata(path: str | os.PathLike[str], wanted: Callable[[str], bool]) -> dict[str, Value]:
    """The scalar and string values of the keys `wanted` accepts, read within the bounds above. NotGGUF when the
    file is not GGUF or a count or length runs past the end; OSError when it cannot be opened or is not a regular
    file."""
    with open_regular(path) as f:
        return _Reader(f, min(os.fstat(f.fileno()).st_size, MAX_METADATA_BYTES)).metadata(wanted)


class _Reader:
    """The file's bytes through a window of CHUNK bytes: `base` is the file offset of the window's first byte,
    `off` the read position in it."""

    def __init__(self, f: BinaryIO, end: int) -> None:
        self.f, self.end = f, end
        self.window, self.base, self.off = b"", 0, 0

    @property
    def pos(self) -> int:
        return self.base + self.off

    def metadata(self, wanted: Callable[[str], bool]) -> dict[str, Value]:
        if self.take(4) != MAGIC:
            raise NotGGUF("not a GGUF file (no GGUF magic)")
        version = self.scalar(4)
        if version not in (2, 3):
            raise NotGGUF(f"GGUF version {version} (this reader takes 2 and 3, little-endian)")
        self.scalar(10)  # the tensor count: the tensors' descriptions come after the key-values, never read here
        count = self.count(10, 8 + 4 + 1)  # the smallest key-value: an empty key, its type, a u8
        found: dict[str, Value] = {}
        for _ in range(count):
            length = self.count(10, 1)
            if length > MAX_KEY_BYTES:
                raise NotGGUF(f"a key of {length} bytes at offset {self.pos}")
            key = self.take(length).decode("utf-8", "replace")
            kind = int(self.scalar(4))
            if kind == ARRAY:
                self.skip_array()
            elif wanted(key):
                found[key] = self.value(kind)
            else:
                self.skip_value(kind)
        return found

    def need(self, n: int) -> None:
        if n > self.end - self.pos:
            raise NotGGUF(f"{n} bytes claimed at offset {self.pos}, past the metadata's end ({self.end})")

    def fill(self, n: int) -> None:
        """At least n bytes in the window from the read position (checked against the metadata's end first)."""
        self.need(n)
        if self.off + n > len(self.window):  # the window moves on: what is left of it, and the next chunk
            rest = self.window[self.off:]
            self.window, self.base, self.off = rest + self.f.read(max(CHUNK, n - len(rest))), self.pos, 0
            if n > len(self.window):
                raise NotGGUF(f"the file ends at offset {self.base + len(self.window)} (it shrank while read)")

    def take(self, n: int) -> bytes:
        self.fill(n)
        self.off += n
        return self.window[self.off - n:self.off]

    def skip(self, n: int) -> None:
        self.need(n)
        if self.off + n <= len(self.window):
            self.off += n
        else:  # past the window: the file's position moves instead, and the window starts empty there
            self.f.seek(self.off + n - len(self.window), os.SEEK_CUR)
            self.window, self.base, self.off = b"", self.pos + n, 0

    def scalar(self, kind: int) -> Value:
        if kind not in _SCALARS:
            raise NotGGUF(f"value type {kind} at offset {self.pos}")
        value: Value = _SCALARS[kind].unpack(self.take(_SCALARS[kind].size))[0]
        return value

    def count(self, kind: int, each: int) -> int:
        """A count or length of items of at least `each` bytes, checked against the bytes left."""
        n = int(self.scalar(kind))
        self.need(n * each)
        return n

    def value(self, kind: int) -> Value:
        if kind == STRING:
            return self.take(self.count(10, 1)).decode("utf-8", "replace")
        return self.scalar(kind)

    def skip_value(self, kind: int) -> None:
        if kind == STRING:
            self.skip(self.count(10, 1))
        elif kind in _SCALARS:
            self.skip(_SCALARS[kind].size)
        else:
            raise NotGGUF(f"value type {kind} at offset {self.pos}")

    def skip_array(self) -> None:
        kind = int(self.scalar(4))
        if kind == STRING:  # a vocabulary's hundreds of thousands of strings: each length read in the window
            u64 = _SCALARS[10]
            for _ in range(self.count(10, 8)):  # each string at least its length
                if self.off + 8 > len(self.window):
                    self.fill(8)
                (length,) = u64.unpack_from(self.window, self.off)
                self.off += 8
                if self.off + length <= len(self.window) and self.base + self.off + length <= self.end:
                    self.off += length
                else:
                    self.skip(length)
        elif kind in _SCALARS:
            self.skip(self.count(10, _SCALARS[kind].size) * _SCALARS[kind].size)
        else:  # nested arrays: llama.cpp reads none
            raise NotGGUF(f"an array of type {kind} at offset {self.pos}")
