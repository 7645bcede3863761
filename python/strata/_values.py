"""Python values as bytes: the tagged format of docs/FORMAT.md, "Python values".

strata.torch stores every value of a state dict that is not a tensor (ints, floats,
strings, bools, None, bytes, io.BytesIO, lists, tuples and dicts of them) as one blob in
this format.
Decoding never executes code: it builds only the types listed here. Pickled values (only
when the caller passes pickle=True on both save and load) and empty tensors (no elements,
so no shard can describe them) have their own blob kinds.

    encode(value) -> bytes             raises NeedsPickle for a value the format lacks
    encode_pickle(value) -> bytes
    encode_empty_tensor(dtype, shape) -> bytes
    decode(data, pickle=False) -> ("value", v) | ("empty", (dtype, shape))
    kind(data) -> "value" | "pickle" | "empty" | None

Errors while decoding raise ValueError with the reason and the byte offset; the caller
turns them into strata.FormatError naming the key.
"""

import io
import pickle as _pickle
import struct

MAGIC_VALUE = b"STV1"
MAGIC_PICKLE = b"STP1"
MAGIC_EMPTY = b"STE1"

MAX_DEPTH = 200          # nesting of lists/tuples/dicts, on both sides
MAX_SAME_HASH = 16       # keys of one dict with one hash value (ints, floats and tuples
                         # hash alike across processes, so colliding keys can be crafted,
                         # and a dict of n such keys takes n^2 comparisons to build)

_F64 = struct.Struct("<d")
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


class NeedsPickle(TypeError):
    """A value of a type the tagged format does not hold. .path: where, inside the value."""

    def __init__(self, msg, path=""):
        super().__init__(msg)
        self.path = path


# ---- encoding ---------------------------------------------------------------------------

def _varint(out, n):
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _bytes_field(out, b):
    _varint(out, len(b))
    out += b


def _utf8(s, path):
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise NeedsPickle("a str that is not valid Unicode (%s)" % e.reason, path)


_KEY_TYPES = (type(None), bool, int, float, str, bytes, tuple)


def _enc(out, v, depth, path):
    t = type(v)
    if v is None:
        out += b"N"
    elif t is bool:
        out += b"T" if v else b"F"
    elif t is int:
        if _I64_MIN <= v <= _I64_MAX:
            out += b"i"
            _varint(out, (v << 1) if v >= 0 else ((-v << 1) - 1))   # zigzag
        else:
            out += b"I"
            out.append(1 if v < 0 else 0)
            mag = -v if v < 0 else v
            _bytes_field(out, mag.to_bytes((mag.bit_length() + 7) // 8, "little"))
    elif t is float:
        out += b"f"
        out += _F64.pack(v)
    elif t is str:
        out += b"s"
        _bytes_field(out, _utf8(v, path))
    elif t is bytes:
        out += b"b"
        _bytes_field(out, v)
    elif t is io.BytesIO:
        # its whole buffer and position (what pickling it keeps), not only what is left
        # to read: training scripts keep serialised state (losses, ...) in one
        out += b"B"
        _bytes_field(out, v.getvalue())
        _varint(out, v.tell())
    elif t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise NeedsPickle("nesting deeper than %d" % MAX_DEPTH, path)
        out += b"l" if t is list else b"t"
        _varint(out, len(v))
        for i, x in enumerate(v):
            _enc(out, x, depth + 1, "%s[%d]" % (path, i))
    elif isinstance(v, dict) and (t is dict or t.__module__ == "collections"):
        # dict, OrderedDict, defaultdict (decoded as dict: the order is kept)
        if depth >= MAX_DEPTH:
            raise NeedsPickle("nesting deeper than %d" % MAX_DEPTH, path)
        if all(type(k) is str for k in v):
            out += b"d"
            _varint(out, len(v))
            for k, x in v.items():
                _bytes_field(out, _utf8(k, path))
                _enc(out, x, depth + 1, "%s[%r]" % (path, k))
        else:
            out += b"D"
            _varint(out, len(v))
            same = {}
            for k, x in v.items():
                if type(k) not in _KEY_TYPES:
                    raise NeedsPickle("a dict key of type %s" % _tname(k), path)
                if _count_hash(same, k) is None:
                    raise NeedsPickle("a dict with more than %d keys of one hash value (a "
                                      "reader refuses it)" % MAX_SAME_HASH, path)
                _enc(out, k, depth + 1, "%s<key %r>" % (path, k))
                _enc(out, x, depth + 1, "%s[%r]" % (path, k))
    else:
        raise NeedsPickle("a value of type %s" % _tname(v), path)


def _count_hash(same, k):
    """Counts k's hash in same ({hash: keys}); None past MAX_SAME_HASH keys of one hash.
    same holds hash values, which hash to themselves and so never collide there."""
    h = hash(k)
    c = same.get(h, 0) + 1
    if c > MAX_SAME_HASH:
        return None
    same[h] = c
    return c


def _tname(v):
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else "%s.%s" % (t.__module__, t.__qualname__)


def encode(value):
    """The tagged encoding of value (MAGIC_VALUE first). NeedsPickle if it has a type the
    format does not hold (its .path says where)."""
    out = bytearray(MAGIC_VALUE)
    _enc(out, value, 0, "")
    return bytes(out)


def encode_pickle(value):
    return MAGIC_PICKLE + _pickle.dumps(value, protocol=4)


def encode_empty_tensor(dtype, shape):
    """dtype: a strata dtype name ("f32"); shape: the tensor's shape (some dim is 0)."""
    out = bytearray(MAGIC_EMPTY)
    _bytes_field(out, dtype.encode("ascii"))
    _varint(out, len(shape))
    for d in shape:
        _varint(out, int(d))
    return bytes(out)


# ---- decoding ---------------------------------------------------------------------------

class _Reader:
    __slots__ = ("b", "i", "n")

    def __init__(self, b, i):
        self.b = b
        self.i = i
        self.n = len(b)

    def fail(self, why):
        raise ValueError("%s at byte %d" % (why, self.i))

    def byte(self):
        if self.i >= self.n:
            self.fail("truncated")
        c = self.b[self.i]
        self.i += 1
        return c

    def varint(self, maxbytes=10):
        shift = 0
        n = 0
        for _ in range(maxbytes):
            c = self.byte()
            n |= (c & 0x7F) << shift
            if not c & 0x80:
                if maxbytes == 10 and n >= 1 << 64:
                    self.fail("varint beyond 64 bits")
                return n
            shift += 7
        self.fail("varint longer than %d bytes" % maxbytes)

    def count(self):
        """A length or item count: never more than the bytes left (each item needs one)."""
        start = self.i
        n = self.varint()
        if n > self.n - self.i:
            self.i = start
            self.fail("count %d larger than the %d bytes left" % (n, self.n - self.i))
        return n

    def raw(self, n):
        b = self.b[self.i:self.i + n]
        self.i += n
        return bytes(b)

    def text(self):
        n = self.count()
        start = self.i
        b = self.raw(n)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            self.i = start
            self.fail("invalid UTF-8")


def _dec(r, depth):
    tag = r.byte()
    if tag == 0x4E:    # N
        return None
    if tag == 0x54:    # T
        return True
    if tag == 0x46:    # F
        return False
    if tag == 0x69:    # i
        z = r.varint()
        return (z >> 1) if not z & 1 else -((z + 1) >> 1)
    if tag == 0x49:    # I
        sign = r.byte()
        if sign > 1:
            r.fail("bad sign byte %d" % sign)
        mag = int.from_bytes(r.raw(r.count()), "little")
        return -mag if sign else mag
    if tag == 0x66:    # f
        if r.n - r.i < 8:
            r.fail("truncated float")
        v = _F64.unpack_from(r.b, r.i)[0]
        r.i += 8
        return v
    if tag == 0x73:    # s
        return r.text()
    if tag == 0x62:    # b
        return r.raw(r.count())
    if tag == 0x42:    # B
        b = io.BytesIO(r.raw(r.count()))
        at = r.i
        pos = r.varint()
        if pos > _I64_MAX:
            r.i = at
            r.fail("a BytesIO position beyond 2^63 - 1")
        b.seek(pos)
        return b
    if tag in (0x6C, 0x74, 0x64, 0x44):   # l t d D
        if depth >= MAX_DEPTH:
            r.fail("nesting deeper than %d" % MAX_DEPTH)
        n = r.count()
        if tag == 0x6C or tag == 0x74:
            items = []
            for _ in range(n):
                items.append(_dec(r, depth + 1))
            return items if tag == 0x6C else tuple(items)
        d = {}
        same = {}
        for _ in range(n):
            at = r.i
            if tag == 0x64:
                k = r.text()
            else:
                k = _dec(r, depth + 1)
                try:
                    c = _count_hash(same, k)
                except TypeError:
                    r.i = at
                    r.fail("unhashable dict key")
                if c is None:
                    r.i = at
                    r.fail("more than %d dict keys of one hash value" % MAX_SAME_HASH)
            if k in d:
                r.i = at
                r.fail("duplicate dict key %r" % (k,))
            d[k] = _dec(r, depth + 1)
        return d
    r.i -= 1
    r.fail("unknown tag 0x%02x" % tag)


def kind(data):
    head = bytes(data[:4])
    return {MAGIC_VALUE: "value", MAGIC_PICKLE: "pickle", MAGIC_EMPTY: "empty"}.get(head)


def decode(data, pickle=False):
    """("value", v) or ("empty", (dtype, shape)). ValueError: malformed (with the byte
    offset); PermissionError: a pickled value and pickle=False."""
    k = kind(data)
    if k is None:
        raise ValueError("not a strata value blob (magic %r)" % bytes(data[:4]))
    if k == "pickle":
        if not pickle:
            raise PermissionError("saved with pickle=True; load it with pickle=True to "
                                  "unpickle it (which may execute code)")
        return "value", _pickle.loads(bytes(data[4:]))
    r = _Reader(bytes(data), 4)
    if k == "empty":
        dtype = r.text()
        nd = r.count()
        at = r.i
        shape = tuple(r.varint() for _ in range(nd))
        if 0 not in shape or max(shape) > _I64_MAX:
            r.i = at
            r.fail("an empty tensor of shape %s: %s" % (
                list(shape), "it has elements" if 0 not in shape else "a dim beyond 2^63 - 1"))
        v = ("empty", (dtype, shape))
    else:
        v = ("value", _dec(r, 0))
    if r.i != r.n:
        r.fail("%d bytes after the value" % (r.n - r.i))
    return v
