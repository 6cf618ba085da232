"""The pixel limit is checked on the dimensions the decoder would use, before it decodes (issue 32: a JPEG whose
real 8192 x 8192 frame header followed a fill byte, with a decoy 32 x 32 one in a comment, passed the check as
32 x 32 and decoded 67 M pixels). A corpus of crafted headers, each format: every one is read at its largest."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from servelm.runners.media import MAX_PIXELS, image_size

BIG = 8192


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def _sof(w: int, h: int, marker: int = 0xC0) -> bytes:
    return _segment(marker, bytes([8]) + struct.pack(">HH", h, w) + bytes([1, 1, 0x11, 0]))


def jpeg_decoy_in_comment_then_fill_byte() -> bytes:
    """The issue's file: a comment holding a 32 x 32 frame header, then the real one after a fill byte (FF FF C0)."""
    return b"\xff\xd8" + _segment(0xFE, b"xx" + _sof(32, 32)) + b"\xff" + _sof(BIG, BIG) + b"\xff\xd9"


def jpeg_big_frame_then_small_frame() -> bytes:
    return b"\xff\xd8" + _sof(BIG, BIG) + _sof(32, 32, 0xC2) + b"\xff\xd9"


def jpeg_many_fill_bytes() -> bytes:
    return b"\xff\xd8" + b"\xff" * 7 + _sof(BIG, BIG) + b"\xff\xd9"


def png(w: int, h: int, first: bytes = b"IHDR") -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    body = chunk(b"tEXt", b"k\x00" + struct.pack(">II", 32, 32)) + chunk(b"IHDR", ihdr) if first != b"IHDR" else chunk(b"IHDR", ihdr)
    return b"\x89PNG\r\n\x1a\n" + body + chunk(b"IEND", b"")


def bmp_core_header(w: int, h: int) -> bytes:
    """OS/2's 12-byte header: 16-bit width and height where the usual header has 32-bit ones."""
    header = struct.pack("<IHHHH", 12, w, h, 1, 24)
    return b"BM" + struct.pack("<IHHI", 14 + 12 + 4, 0, 0, 26) + header + b"\x00" * 4


def gif(w: int, h: int) -> bytes:
    """A real 2 x 2 GIF whose logical screen (the canvas a decoder allocates) says w x h."""
    buf = io.BytesIO()
    Image.new("P", (2, 2)).save(buf, format="GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", w, h)
    return bytes(data)


@pytest.mark.parametrize("data, fmt", [
    (jpeg_decoy_in_comment_then_fill_byte(), "jpeg"), (jpeg_big_frame_then_small_frame(), "jpeg"),
    (jpeg_many_fill_bytes(), "jpeg"), (bmp_core_header(9000, 9000), "bmp"), (gif(BIG, BIG), "gif"),
    (png(BIG, BIG), "png"),
], ids=["jpeg-decoy-comment-fill-byte", "jpeg-two-frames", "jpeg-fill-bytes", "bmp-core-header", "gif", "png"])
def test_a_crafted_header_is_read_at_the_size_the_decoder_would_use(data, fmt):
    got, w, h = image_size(data)
    assert got == fmt and w * h > MAX_PIXELS, (w, h)


def test_a_png_whose_first_chunk_is_not_its_header_is_refused():
    with pytest.raises(ValueError):
        image_size(png(32, 32, first=b"tEXt"))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_real_images_read_their_own_size(fmt):
    buf = io.BytesIO()
    Image.new("RGB", (37, 21), "red").save(buf, format=fmt)
    assert image_size(buf.getvalue()) == (fmt.lower(), 37, 21)


def test_webp_and_junk_are_refused():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="WEBP")
    with pytest.raises(ValueError, match="WebP"):
        image_size(buf.getvalue())
    with pytest.raises(ValueError):
        image_size(b"\xff\xd8\xff\xfe\x00\x04ab")  # a JPEG with no frame header
