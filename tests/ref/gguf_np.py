#!/usr/bin/python3
"""gguf_np.py - an independent GGUF v2/v3 reader in Python + NumPy (reference for moetax tests).

Shares no code with the C engine. Written from the GGUF file format description:

  magic "GGUF" | u32 version (2 or 3) | u64 n_tensors | u64 n_kv          (little-endian)
  n_kv      x { string key | u32 value_type | value }
  n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
  zero padding up to general.alignment (default 32), then the tensor data section;
  a tensor's offset is relative to the start of the data section.
  string = u64 byte length + bytes;  array = u32 element type + u64 count + elements.

Metadata value types: 0 uint8, 1 int8, 2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32,
7 bool, 8 string, 9 array, 10 uint64, 11 int64, 12 float64.

Tensors: ggml ne = [ne0, ne1, ...] (ne0 fastest). NumPy arrays use the reversed shape
(ne2, ne1, ne0), so a weight {in, out} becomes (out, in) and y = W @ x.

Dequantised types (to float32): F32 (0), F16 (1), BF16 (30), Q8_0 (8), Q4_0 (2), Q4_1 (3),
Q5_0 (6), Q5_1 (7), IQ4_NL (20).
  Q8_0 block (34 bytes, 32 values): f16 d, 32 x int8 q;             v = q * d
  Q4_0 block (18 bytes, 32 values): f16 d, 16 bytes; byte j: low nibble = value j,
                                    high nibble = value j + 16;     v = (q - 8) * d
  Q5_0 block (22 bytes, 32 values): f16 d, uint32 qh (little-endian), Q4_0's 16 nibble bytes;
                                    q = nibble + 16 * (bit j of qh) v = (q - 16) * d
  Q4_1 block (20 bytes):            f16 d, f16 m, Q4_0's nibbles;   v = q * d + m
  Q5_1 block (24 bytes):            f16 d, f16 m, then Q5_0's qh and nibbles; v = q * d + m
  IQ4_NL block (18 bytes):          Q4_0's layout;                  v = d * IQ4NL_LEVELS[nibble]
Other ggml types are listed (name, block size, block bytes) so sizes, offsets and raw-byte
checksums work for them; dequantising them raises NotImplementedError.

Python API
  r = GGUFReader(path)
  r.version, r.alignment, r.data_offset, r.n_tensors, r.file_size
  r.metadata            dict key -> value (int/float/bool/str; arrays -> list, nested lists)
  r.metadata_types      dict key -> type name ("uint32", "string", "array[float32]", ...)
  r.get(key, default)   r.arch (general.architecture) and r.key(suffix) -> "<arch>.<suffix>" value
  r.tensors             dict name -> TensorInfo (in file order): name, ne, type, type_name,
                        offset (relative), abs_offset, nbytes, shape (numpy order), n_elements
  r.raw(name)           np.uint8 view (memmap) of the tensor's bytes
  r.tensor(name)        float32 ndarray, numpy shape, dequantised
  r.rows(name, idx)     float32 rows of a 2-D tensor (numpy axis 0 = ne1), dequantised
  r.slice3(name, i)     float32 matrix i of a 3-D tensor (numpy axis 0 = ne2), dequantised
  dequantize(raw_uint8, type_id, n) -> float32 1-D
  fnv1a64(bytes_like) -> int   (uses a tiny compiled helper when a C compiler is present,
                                else a pure-Python loop; set GGUF_NP_NO_CC=1 to force Python)

CLI
  /usr/bin/python3 tests/ref/gguf_np.py FILE            human-readable listing
  /usr/bin/python3 tests/ref/gguf_np.py FILE --json     JSON lines:
     line 1: {"version":V,"alignment":A,"data_offset":D,"n_tensors":T,"n_kv":K,
              "metadata":{key: value, ...}}   (arrays longer than 16 elements are written as
              {"type": "<element type>", "n": N}; float values are the stored value widened
              to double)
     then one line per tensor, in file order:
             {"name","type","ne","offset","nbytes","fnv1a64","sum","sumsq"}
     offset = relative to the data section (as stored); fnv1a64 = "%016x" of the raw bytes;
     sum / sumsq = float64 sums of the dequantised float32 values (null if the type cannot
     be dequantised here).
  --no-checksums   skip fnv1a64/sum/sumsq (null) for a fast listing.
"""

import ctypes
import json
import math
import mmap
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)

VALUE_TYPE_NAMES = {
    T_UINT8: "uint8", T_INT8: "int8", T_UINT16: "uint16", T_INT16: "int16",
    T_UINT32: "uint32", T_INT32: "int32", T_FLOAT32: "float32", T_BOOL: "bool",
    T_STRING: "string", T_ARRAY: "array", T_UINT64: "uint64", T_INT64: "int64",
    T_FLOAT64: "float64",
}
# numpy dtype for the scalar types
SCALAR_DTYPES = {
    T_UINT8: np.dtype("<u1"), T_INT8: np.dtype("<i1"), T_UINT16: np.dtype("<u2"),
    T_INT16: np.dtype("<i2"), T_UINT32: np.dtype("<u4"), T_INT32: np.dtype("<i4"),
    T_FLOAT32: np.dtype("<f4"), T_BOOL: np.dtype("<u1"), T_UINT64: np.dtype("<u8"),
    T_INT64: np.dtype("<i8"), T_FLOAT64: np.dtype("<f8"),
}

# ggml tensor types: id -> (name, values per block, bytes per block)
# (names as moetax prints them: lower case, "q4_k" where ggml itself writes "q4_K")
GGML_TYPES = {
    0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 9: ("q8_1", 32, 36),
    10: ("q2_k", 256, 84), 11: ("q3_k", 256, 110), 12: ("q4_k", 256, 144),
    13: ("q5_k", 256, 176), 14: ("q6_k", 256, 210), 15: ("q8_k", 256, 292),
    16: ("iq2_xxs", 256, 66), 17: ("iq2_xs", 256, 74), 18: ("iq3_xxs", 256, 98),
    19: ("iq1_s", 256, 50), 20: ("iq4_nl", 32, 18), 21: ("iq3_s", 256, 110),
    22: ("iq2_s", 256, 82), 23: ("iq4_xs", 256, 136), 24: ("i8", 1, 1), 25: ("i16", 1, 2),
    26: ("i32", 1, 4), 27: ("i64", 1, 8), 28: ("f64", 1, 8), 29: ("iq1_m", 256, 56),
    30: ("bf16", 1, 2), 34: ("tq1_0", 256, 54), 35: ("tq2_0", 256, 66),
    39: ("mxfp4", 32, 17),
}
GGML_TYPE_IDS = {v[0]: k for k, v in GGML_TYPES.items()}
TYPE_F32, TYPE_F16, TYPE_Q4_0, TYPE_Q8_0, TYPE_BF16 = 0, 1, 2, 8, 30
TYPE_Q5_0, TYPE_IQ4_NL, TYPE_Q4_1, TYPE_Q5_1 = 6, 20, 3, 7
DEQUANT_TYPES = (TYPE_F32, TYPE_F16, TYPE_BF16, TYPE_Q8_0, TYPE_Q4_0, TYPE_Q5_0, TYPE_IQ4_NL, TYPE_Q4_1, TYPE_Q5_1)
# ggml's kvalues_iq4nl (ggml-common.h)
IQ4NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=np.float32)


class GGUFError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# dequantisation (vectorised; no Python loop per block)

def dequantize(raw, type_id, n=None):
    """raw: uint8 1-D array (bytes of whole blocks) -> float32 1-D array of n values."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if type_id == TYPE_F32:
        out = raw.view("<f4").astype(np.float32, copy=True)
    elif type_id == TYPE_F16:
        out = raw.view("<f2").astype(np.float32)
    elif type_id == TYPE_BF16:
        out = (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    elif type_id == TYPE_Q8_0:
        if raw.size % 34:
            raise GGUFError("q8_0 data is not a whole number of 34-byte blocks")
        b = raw.reshape(-1, 34)
        d = np.ascontiguousarray(b[:, :2]).view("<f2").astype(np.float32)      # (nb, 1)
        q = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)   # (nb, 32)
        out = (q * d).reshape(-1)
    elif type_id == TYPE_Q4_0:
        if raw.size % 18:
            raise GGUFError("q4_0 data is not a whole number of 18-byte blocks")
        b = raw.reshape(-1, 18)
        d = np.ascontiguousarray(b[:, :2]).view("<f2").astype(np.float32)      # (nb, 1)
        qs = b[:, 2:]                                                          # (nb, 16)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8)      # (nb, 32)
        out = ((q.astype(np.float32) - np.float32(8.0)) * d).reshape(-1)
    elif type_id == TYPE_Q5_0:
        if raw.size % 22:
            raise GGUFError("q5_0 data is not a whole number of 22-byte blocks")
        b = raw.reshape(-1, 22)
        d = np.ascontiguousarray(b[:, :2]).view("<f2").astype(np.float32)      # (nb, 1)
        qh = np.ascontiguousarray(b[:, 2:6]).view("<u4")                       # (nb, 1)
        qs = b[:, 6:]                                                          # (nb, 16)
        lo = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)    # (nb, 32)
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)     # (nb, 32)
        out = ((lo + 16 * hi - 16).astype(np.float32) * d).reshape(-1)
    elif type_id in (TYPE_Q4_1, TYPE_Q5_1):
        bs = 20 if type_id == TYPE_Q4_1 else 24
        if raw.size % bs:
            raise GGUFError("%s data is not a whole number of %d-byte blocks" % (GGML_TYPES[type_id][0], bs))
        b = raw.reshape(-1, bs)
        d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32)     # (nb, 1)
        m = np.ascontiguousarray(b[:, 2:4]).view("<f2").astype(np.float32)     # (nb, 1)
        qs = b[:, bs - 16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)     # (nb, 32)
        if type_id == TYPE_Q5_1:
            qh = np.ascontiguousarray(b[:, 4:8]).view("<u4")
            q += 16 * ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
        out = (q.astype(np.float32) * d + m).reshape(-1)
    elif type_id == TYPE_IQ4_NL:
        if raw.size % 18:
            raise GGUFError("iq4_nl data is not a whole number of 18-byte blocks")
        b = raw.reshape(-1, 18)
        d = np.ascontiguousarray(b[:, :2]).view("<f2").astype(np.float32)      # (nb, 1)
        qs = b[:, 2:]
        idx = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        out = (d * IQ4NL_LEVELS[idx]).reshape(-1)
    else:
        name = GGML_TYPES.get(type_id, ("type %d" % type_id,))[0]
        raise NotImplementedError("dequantisation of %s is not implemented" % name)
    if n is not None and out.size != n:
        if out.size < n:
            raise GGUFError("not enough data: %d values, expected %d" % (out.size, n))
        out = out[:n]
    return out


def row_bytes(type_id, n):
    """Bytes of n consecutive values of a ggml type (n a multiple of the block size)."""
    name, blck, tsize = GGML_TYPES[type_id]
    if n % blck:
        raise GGUFError("%d values is not a multiple of the %s block size %d" % (n, name, blck))
    return n // blck * tsize


# --------------------------------------------------------------------------------------------
# FNV-1a 64

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1

_FNV_C_SRC = r"""
#include <stdint.h>
#include <stddef.h>
uint64_t fnv1a64_update(uint64_t h, const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ULL; }
    return h;
}
"""
_fnv_lib = None
_fnv_tried = False


def _load_fnv_helper():
    """Compile (once, cached) a 3-line C helper for speed; None if no compiler."""
    global _fnv_lib, _fnv_tried
    if _fnv_tried:
        return _fnv_lib
    _fnv_tried = True
    if os.environ.get("GGUF_NP_NO_CC"):
        return None
    cache = os.path.join(tempfile.gettempdir(), "gguf_np_fnv_%d" % os.getuid())
    so = os.path.join(cache, "fnv1a64.so")
    try:
        if not os.path.exists(so):
            os.makedirs(cache, exist_ok=True)
            src = os.path.join(cache, "fnv1a64.c")
            with open(src, "w") as f:
                f.write(_FNV_C_SRC)
            tmp = so + ".%d.tmp" % os.getpid()
            for cc in ("cc", "gcc", "clang"):
                try:
                    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, src],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                except OSError:
                    continue
                if r.returncode == 0:
                    os.replace(tmp, so)
                    break
        lib = ctypes.CDLL(so)
        lib.fnv1a64_update.restype = ctypes.c_uint64
        lib.fnv1a64_update.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        # self-check against the Python definition
        probe = np.frombuffer(b"moetax fnv probe", dtype=np.uint8)
        if lib.fnv1a64_update(FNV_OFFSET, probe.ctypes.data, probe.size) != _fnv_py(probe, FNV_OFFSET):
            return None
        _fnv_lib = lib
    except Exception:
        _fnv_lib = None
    return _fnv_lib


def _fnv_py(data, h=FNV_OFFSET):
    for b in bytes(data):
        h = ((h ^ b) * FNV_PRIME) & _MASK64
    return h


def fnv1a64(data, h=FNV_OFFSET):
    """FNV-1a 64-bit hash of a bytes-like / uint8 array (offset basis 0xcbf29ce484222325,
    prime 0x100000001b3: for each byte h ^= b; h *= prime mod 2^64)."""
    arr = np.ascontiguousarray(np.asarray(data, dtype=np.uint8).reshape(-1)) \
        if not isinstance(data, (bytes, bytearray)) else np.frombuffer(bytes(data), dtype=np.uint8)
    lib = _load_fnv_helper()
    if lib is not None:
        step = 1 << 26
        for i in range(0, arr.size, step):
            chunk = np.ascontiguousarray(arr[i:i + step])
            h = lib.fnv1a64_update(h, chunk.ctypes.data, chunk.size)
        return int(h)
    return _fnv_py(arr, h)


# --------------------------------------------------------------------------------------------
# reader

class TensorInfo:
    __slots__ = ("name", "ne", "type", "type_name", "offset", "abs_offset", "nbytes",
                 "shape", "n_elements", "info_offset")

    def __repr__(self):
        return "TensorInfo(%s, %s, ne=%s, offset=%d, nbytes=%d)" % (
            self.name, self.type_name, self.ne, self.offset, self.nbytes)


class _Cursor:
    def __init__(self, buf, size):
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n, what):
        if n < 0 or self.pos + n > self.size:
            raise GGUFError("truncated file: %s at byte %d needs %d bytes (file has %d)"
                            % (what, self.pos, n, self.size))

    def unpack(self, fmt, what):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what):
        n = self.unpack("<Q", what + " length")
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s.decode("utf-8", errors="surrogateescape")

    def array_np(self, dtype, n, what):
        nb = dtype.itemsize * n
        self.need(nb, what)
        a = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
        self.pos += nb
        return a


class GGUFReader:
    def __init__(self, path):
        self.path = path
        self._f = open(path, "rb")
        self.file_size = os.fstat(self._f.fileno()).st_size
        if self.file_size == 0:
            raise GGUFError("%s: empty file" % path)
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        self._u8 = np.frombuffer(self._mm, dtype=np.uint8)
        self.metadata = {}
        self.metadata_types = {}
        self.tensors = {}
        self._parse()

    # ---- parsing -----------------------------------------------------------------------
    def _value(self, c, vtype, key, depth=0):
        if vtype == T_STRING:
            return c.string(key)
        if vtype == T_ARRAY:
            if depth > 8:
                raise GGUFError("%s: arrays nested too deeply" % key)
            etype = c.unpack("<I", key + " array type")
            n = c.unpack("<Q", key + " array count")
            if etype in SCALAR_DTYPES:
                a = c.array_np(SCALAR_DTYPES[etype], n, key)
                if etype == T_BOOL:
                    return [bool(x) for x in a]
                return a.tolist()
            if etype == T_STRING:
                return [c.string(key) for _ in range(n)]
            if etype == T_ARRAY:
                return [self._value(c, T_ARRAY, key, depth + 1) for _ in range(n)]
            raise GGUFError("%s: unknown array element type %d" % (key, etype))
        if vtype in SCALAR_DTYPES:
            dt = SCALAR_DTYPES[vtype]
            v = c.array_np(dt, 1, key)[0]
            if vtype == T_BOOL:
                return bool(v)
            if vtype in (T_FLOAT32, T_FLOAT64):
                return float(v)
            return int(v)
        raise GGUFError("%s: unknown value type %d" % (key, vtype))

    def _parse(self):
        c = _Cursor(self._mm, self.file_size)
        magic = bytes(self._mm[0:4]) if self.file_size >= 4 else b""
        if magic != GGUF_MAGIC:
            raise GGUFError("%s: bad magic %r" % (self.path, magic))
        c.pos = 4
        self.version = c.unpack("<I", "version")
        if self.version not in (2, 3):
            raise GGUFError("%s: unsupported GGUF version %d" % (self.path, self.version))
        self.n_tensors = c.unpack("<Q", "tensor count")
        self.n_kv = c.unpack("<Q", "metadata count")
        for _ in range(self.n_kv):
            key = c.string("key")
            vtype = c.unpack("<I", key + " type")
            if vtype == T_ARRAY:
                # peek the element type for metadata_types
                etype = struct.unpack_from("<I", self._mm, c.pos)[0] if c.pos + 4 <= self.file_size else -1
                tname = "array[%s]" % VALUE_TYPE_NAMES.get(etype, str(etype))
            else:
                tname = VALUE_TYPE_NAMES.get(vtype, str(vtype))
            val = self._value(c, vtype, key)
            if key in self.metadata:
                raise GGUFError("duplicate key %s" % key)
            self.metadata[key] = val
            self.metadata_types[key] = tname
        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a = self.metadata["general.alignment"]
            if not isinstance(a, int) or a <= 0 or (a & (a - 1)):
                raise GGUFError("bad general.alignment %r" % (a,))
            self.alignment = a
        infos = []
        for _ in range(self.n_tensors):
            t = TensorInfo()
            t.info_offset = c.pos
            t.name = c.string("tensor name")
            nd = c.unpack("<I", t.name + " n_dims")
            if nd < 1 or nd > 4:
                raise GGUFError("%s: n_dims %d" % (t.name, nd))
            t.ne = [c.unpack("<Q", t.name + " ne") for _ in range(nd)]
            t.type = c.unpack("<I", t.name + " type")
            t.offset = c.unpack("<Q", t.name + " offset")
            if t.type not in GGML_TYPES:
                raise GGUFError("%s: unknown ggml type %d" % (t.name, t.type))
            t.type_name, blck, tsize = GGML_TYPES[t.type]
            t.n_elements = int(np.prod(t.ne, dtype=np.int64)) if t.ne else 1
            if t.ne[0] % blck:
                raise GGUFError("%s: ne0 %d not a multiple of block %d" % (t.name, t.ne[0], blck))
            t.nbytes = t.n_elements // blck * tsize
            t.shape = tuple(reversed(t.ne))
            if t.name in self.tensors:
                raise GGUFError("duplicate tensor %s" % t.name)
            self.tensors[t.name] = t
            infos.append(t)
        self.info_end = c.pos
        self.data_offset = (c.pos + self.alignment - 1) // self.alignment * self.alignment
        for t in infos:
            if t.offset % self.alignment:
                raise GGUFError("%s: offset %d not aligned to %d" % (t.name, t.offset, self.alignment))
            t.abs_offset = self.data_offset + t.offset
            if t.abs_offset + t.nbytes > self.file_size:
                raise GGUFError("%s: data [%d, %d) past end of file %d"
                                % (t.name, t.abs_offset, t.abs_offset + t.nbytes, self.file_size))

    # ---- metadata ------------------------------------------------------------------------
    def get(self, key, default=None):
        return self.metadata.get(key, default)

    @property
    def arch(self):
        return self.metadata.get("general.architecture")

    def key(self, suffix, default=None):
        return self.metadata.get("%s.%s" % (self.arch, suffix), default)

    # ---- tensors ------------------------------------------------------------------------
    def __contains__(self, name):
        return name in self.tensors

    def info(self, name):
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError("no tensor %s" % name) from None

    def raw(self, name):
        t = self.info(name)
        return self._u8[t.abs_offset:t.abs_offset + t.nbytes]

    def tensor(self, name):
        t = self.info(name)
        return dequantize(self.raw(name), t.type, t.n_elements).reshape(t.shape)

    def rows(self, name, idx):
        """Rows idx (numpy axis 0 of a 2-D tensor, i.e. ggml ne1 index) dequantised."""
        t = self.info(name)
        if len(t.ne) != 2:
            raise GGUFError("%s: rows() needs a 2-D tensor" % name)
        rb = row_bytes(t.type, t.ne[0])
        idx = np.atleast_1d(np.asarray(idx, dtype=np.int64))
        if idx.size and (idx.min() < 0 or idx.max() >= t.ne[1]):
            raise IndexError("%s: row index out of range" % name)
        base = self.raw(name).reshape(t.ne[1], rb)
        return dequantize(base[idx].reshape(-1), t.type, idx.size * t.ne[0]).reshape(idx.size, t.ne[0])

    def slice3(self, name, i):
        """Matrix i of a 3-D tensor (numpy axis 0 = ggml ne2), dequantised, shape (ne1, ne0)."""
        t = self.info(name)
        if len(t.ne) != 3:
            raise GGUFError("%s: slice3() needs a 3-D tensor" % name)
        per = row_bytes(t.type, t.ne[0]) * t.ne[1]
        raw = self.raw(name)[i * per:(i + 1) * per]
        return dequantize(raw, t.type, t.ne[0] * t.ne[1]).reshape(t.ne[1], t.ne[0])

    def checksums(self, name, chunk_values=1 << 24):
        """(fnv1a64 hex, sum, sumsq) of one tensor; sums None if not dequantisable."""
        t = self.info(name)
        raw = self.raw(name)
        h = "%016x" % fnv1a64(raw)
        if t.type not in DEQUANT_TYPES:
            return h, None, None
        name_, blck, tsize = GGML_TYPES[t.type]
        nblocks = t.nbytes // tsize
        bpc = max(1, chunk_values // blck)
        s = 0.0
        ss = 0.0
        for b0 in range(0, nblocks, bpc):
            b1 = min(nblocks, b0 + bpc)
            v = dequantize(raw[b0 * tsize:b1 * tsize], t.type).astype(np.float64)
            s += float(np.sum(v))
            ss += float(np.dot(v, v))
        return h, s, ss

    def close(self):
        try:
            del self._u8
            self._mm.close()
        except Exception:
            pass
        self._f.close()


# --------------------------------------------------------------------------------------------
# CLI

def _json_value(v, tname):
    if isinstance(v, list):
        if len(v) > 16:
            et = tname[len("array["):-1] if tname.startswith("array[") else "?"
            return {"type": et, "n": len(v)}
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _metadata_json(r):
    return {k: _json_value(v, r.metadata_types[k]) for k, v in r.metadata.items()}


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="List a GGUF file (independent reference reader).")
    ap.add_argument("file")
    ap.add_argument("--json", action="store_true", help="JSON lines output")
    ap.add_argument("--no-checksums", action="store_true", help="skip fnv1a64 and sums")
    a = ap.parse_args(argv)
    r = GGUFReader(a.file)
    out = sys.stdout
    if a.json:
        head = {"version": r.version, "alignment": r.alignment, "data_offset": r.data_offset,
                "n_tensors": r.n_tensors, "n_kv": r.n_kv, "metadata": _metadata_json(r)}
        out.write(json.dumps(head, ensure_ascii=False) + "\n")
    else:
        out.write("GGUF v%d  %d tensors  %d kv  alignment %d  data at %d\n"
                  % (r.version, r.n_tensors, r.n_kv, r.alignment, r.data_offset))
        for k, v in _metadata_json(r).items():
            out.write("  %-50s %-16s %s\n" % (k, r.metadata_types[k], json.dumps(v, ensure_ascii=False)))
    for t in r.tensors.values():
        if a.no_checksums:
            h, s, ss = None, None, None
        else:
            h, s, ss = r.checksums(t.name)
        if a.json:
            out.write(json.dumps({"name": t.name, "type": t.type_name, "ne": t.ne,
                                  "offset": t.offset, "nbytes": t.nbytes, "fnv1a64": h,
                                  "sum": s, "sumsq": ss}) + "\n")
        else:
            out.write("%-40s %-6s %-22s off %-10d %10d B  fnv %s  sum %s  sumsq %s\n"
                      % (t.name, t.type_name, str(t.ne), t.offset, t.nbytes, h,
                         "-" if s is None else "%.9g" % s, "-" if ss is None else "%.9g" % ss))
    r.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        sys.exit(0)
