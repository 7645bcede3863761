"""Flipping one byte inside a tensor's data in a zip archive (torch.save files, DCP items,
DeepSpeed partitions, Megatron's common.pt), the byte found from the entry's local header:
tests/python/test_foreign_crc.py, test_zero_source.py, test_megatron_source.py."""

import ctypes
import io
import struct
import zipfile


def raw(t):
    """The bytes of tensor t (contiguous, as torch.save stores them)."""
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def entries(data):
    """[(name, offset of its first data byte in data, size)] of the stored entries of the zip
    archive `data` (bytes): each offset from its local header (signature, then the name and
    extra field lengths at 26 and 28)."""
    out = []
    for i in zipfile.ZipFile(io.BytesIO(data)).infolist():
        if i.compress_type != zipfile.ZIP_STORED:
            continue
        h = i.header_offset
        assert data[h:h + 4] == b"PK\x03\x04", i.filename
        n, e = struct.unpack("<HH", data[h + 26:h + 30])
        out.append((i.filename, h + 30 + n + e, i.file_size))
    return out


def entry_of(data, want):
    """(name, offset of want's first byte) of the stored entry of the archive `data` whose
    bytes hold want (a tensor's bytes: its storage's entry)."""
    for name, at, size in entries(data):
        i = data.find(want, at, at + size)
        if i >= 0:
            return name, i
    raise AssertionError("no zip entry holds those bytes")


def flip(path, at):
    """XORs the byte at offset `at` of the file at path with 0x10."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
