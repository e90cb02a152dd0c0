#!/usr/bin/python3
# ctest-labels: unit
"""test_hostile.py - one-mutation-each GGUF files made from the tiny generated
model, each run through `inspect`, `inspect --checksums --json`, `run -n 2` and
`eval` (issue 21). For every file and command: no signal, no sanitizer report,
valid JSON where --json is asked; files that must be refused exit non-zero with
a message naming the field or tensor; valid-but-odd files (alignment 1 with odd
offsets, an unknown tokenizer.ggml.pre) give the logits of the original file.
Registered like every tests/test_*.py: the ASan build's test runs the ASan binary.

usage: test_hostile.py MOETAX_BIN WORKDIR
"""
import json
import os
import struct
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

# ---- a small GGUF reader/writer that keeps every value's type ---------------------------------
T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 = range(13)
SCALAR = {T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i", T_F32: "<f",
          T_BOOL: "<?", T_U64: "<Q", T_I64: "<q", T_F64: "<d"}
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 30: (1, 2)}  # f32 f16 q4_0 q8_0 bf16


class Gguf:
    def __init__(self, path):
        b = open(path, "rb").read()
        self.pos = 0
        self.b = b
        assert b[:4] == b"GGUF"
        self.version, n_t, n_kv = struct.unpack_from("<IQQ", b, 4)
        self.pos = 24
        self.kv = []  # [key, type, value]; arrays: (elem_type, [values])
        for _ in range(n_kv):
            k = self._str()
            t = self._u32()
            self.kv.append([k, t, self._val(t)])
        self.tensors = []  # [name, ne list, type, bytes]
        infos = []
        for _ in range(n_t):
            name = self._str()
            nd = self._u32()
            ne = list(struct.unpack_from("<%dQ" % nd, b, self.pos))
            self.pos += 8 * nd
            ty = self._u32()
            off = struct.unpack_from("<Q", b, self.pos)[0]
            self.pos += 8
            infos.append((name, ne, ty, off))
        align = self.get("general.alignment", 32)
        data = (self.pos + align - 1) // align * align
        for name, ne, ty, off in infos:
            blck, bs = BLOCK[ty]
            n = ne[0] // blck * bs
            for d in ne[1:]:
                n *= d
            self.tensors.append([name, ne, ty, b[data + off:data + off + n]])

    def _u32(self):
        v = struct.unpack_from("<I", self.b, self.pos)[0]
        self.pos += 4
        return v

    def _str(self):
        n = struct.unpack_from("<Q", self.b, self.pos)[0]
        s = self.b[self.pos + 8:self.pos + 8 + n].decode()
        self.pos += 8 + n
        return s

    def _val(self, t):
        if t == T_STR:
            return self._str()
        if t == T_ARR:
            et = self._u32()
            n = struct.unpack_from("<Q", self.b, self.pos)[0]
            self.pos += 8
            return (et, [self._val(et) for _ in range(n)])
        f = SCALAR[t]
        v = struct.unpack_from(f, self.b, self.pos)[0]
        self.pos += struct.calcsize(f)
        return v

    def get(self, key, default=None):
        for k, t, v in self.kv:
            if k == key:
                return v
        return default

    def set(self, key, t, v):
        for e in self.kv:
            if e[0] == key:
                e[1], e[2] = t, v
                return
        self.kv.append([key, t, v])

    def tensor(self, name):
        return next(t for t in self.tensors if t[0] == name)

    @staticmethod
    def _wstr(s):
        s = s.encode()
        return struct.pack("<Q", len(s)) + s

    def _wval(self, t, v):
        if t == T_STR:
            return self._wstr(v)
        if t == T_ARR:
            et, vals = v
            return struct.pack("<IQ", et, len(vals)) + b"".join(self._wval(et, x) for x in vals)
        return struct.pack(SCALAR[t], v)

    def write(self, path, gap=0, ne_override=None):
        """gap: bytes left between tensors (odd offsets when the alignment is 1)."""
        align = self.get("general.alignment", 32)
        out = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv))]
        for k, t, v in self.kv:
            out += [self._wstr(k), struct.pack("<I", t), self._wval(t, v)]
        off = 0
        offs = []
        for name, ne, ty, data in self.tensors:
            off = (off + align - 1) // align * align
            offs.append(off)
            off += len(data) + gap
        for (name, ne, ty, data), o in zip(self.tensors, offs):
            ne = (ne_override or {}).get(name, ne)
            out += [self._wstr(name), struct.pack("<I", len(ne)), struct.pack("<%dQ" % len(ne), *ne),
                    struct.pack("<IQ", ty, o)]
        head = b"".join(out)
        pad = (len(head) + align - 1) // align * align - len(head)
        body = bytearray(offs[-1] + len(self.tensors[-1][3]) if self.tensors else 0)
        for (name, ne, ty, data), o in zip(self.tensors, offs):
            body[o:o + len(data)] = data
        with open(path, "wb") as f:
            f.write(head + b"\0" * pad + bytes(body))
        return len(head) + pad


# ---- running moetax ---------------------------------------------------------------------------------
SAN = ("AddressSanitizer", "UndefinedBehaviorSanitizer", "runtime error:", "LeakSanitizer")


def run(args):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=300)


def sane(r, what):
    """No signal, no sanitizer report; a JSON stdout parses when asked for."""
    check(r.returncode >= 0, f"{what}: killed by signal {-r.returncode}: {r.stderr[-400:]}")
    check(not any(s in r.stderr for s in SAN), f"{what}: sanitizer report: {r.stderr[-1500:]}")


def commands(mt, path):
    return {
        "inspect": [mt, "inspect", path],
        "inspect --checksums --json": [mt, "inspect", "--checksums", "--json", path],
        "run -n 2": [mt, "run", "-m", path, "-p", "def f(", "-n", "2", "--temp", "0", "-t", "1"],
        "eval": [mt, "eval", "-m", path, "--tokens", "1,2,3", "-t", "1"],
    }


def expect_refused(mt, path, needle, what, load_only=True):
    """The model commands (run, eval) must refuse the file naming `needle`; inspect may describe it
    (it reads GGUF structure, not hyper-parameters) but must not crash and must print valid JSON."""
    for name, args in commands(mt, path).items():
        r = run(args)
        w = f"{what}: {name}"
        sane(r, w)
        if name.startswith("inspect --checksums --json") and r.returncode == 0:
            try:
                json.loads(r.stdout)
            except ValueError as e:
                check(False, f"{w}: stdout is not valid JSON ({e}): {r.stdout[:300]}")
        model_cmd = not name.startswith("inspect")
        if model_cmd or not load_only:
            check(r.returncode != 0, f"{w}: exit status 0, expected a refusal naming '{needle}'")
            check(needle in r.stderr, f"{w}: message does not name '{needle}': {r.stderr.strip()[-400:]}")


def eval_logits(mt, path, out, ref_kernels=False):
    env = dict(os.environ, MOETAX_FORCE_REF="1") if ref_kernels else None
    r = subprocess.run([mt, "eval", "-m", path, "--tokens", "1,2,3,4", "-t", "1", "-o", out], capture_output=True,
                       text=True, errors="replace", timeout=300, env=env)
    sane(r, f"eval {path}")
    check(r.returncode == 0, f"eval {os.path.basename(path)}: rc {r.returncode}: {r.stderr.strip()[-600:]}")
    return open(out, "rb").read() if r.returncode == 0 and os.path.exists(out) else None


def main():
    mt, work = sys.argv[1], os.path.join(sys.argv[2], "hostile")
    os.makedirs(work, exist_ok=True)
    base = {}
    for preset in ("tiny", "tiny-v3"):
        for ty in ("f32", "q8_0"):
            p = os.path.join(work, f"{preset}-{ty}.gguf")
            r = run([mt, "gen", "--preset", preset, "--type", ty, "-o", p])
            check(r.returncode == 0, f"gen {preset} {ty}: {r.stderr}")
            base[(preset, ty)] = p
    A = "deepseek2."

    def mutant(name, src, edit, **wkw):
        g = Gguf(base[src])
        edit(g)
        p = os.path.join(work, name + ".gguf")
        g.write(p, **wkw)
        return p

    # --- hyper-parameters the loader refuses (item 4), each naming its key
    hp_cases = [
        ("freq_base_0", ("tiny", "f32"), A + "rope.freq_base", T_F32, 0.0, "rope.freq_base"),
        ("freq_base_neg", ("tiny", "f32"), A + "rope.freq_base", T_F32, -1.0, "rope.freq_base"),
        ("freq_base_nan", ("tiny", "f32"), A + "rope.freq_base", T_F32, float("nan"), "rope.freq_base"),
        ("freq_base_tiny", ("tiny", "f32"), A + "rope.freq_base", T_F32, 1e-30, "rope.freq_base"),
        ("yarn_factor_neg", ("tiny-v3", "f32"), A + "rope.scaling.factor", T_F32, -4.0, "rope.scaling.factor"),
        ("yarn_factor_half", ("tiny-v3", "f32"), A + "rope.scaling.factor", T_F32, 0.5, "rope.scaling.factor"),
        ("attn_factor_neg", ("tiny-v3", "f32"), A + "rope.scaling.attn_factor", T_F32, -1.0, "attn_factor"),
        ("attn_factor_0", ("tiny", "f32"), A + "rope.scaling.attn_factor", T_F32, 0.0, "attn_factor"),
        ("yarn_log_mul_huge", ("tiny-v3", "f32"), A + "rope.scaling.yarn_log_multiplier", T_F32, 1e30,
         "yarn_log_multiplier"),
        ("ext_factor_big", ("tiny-v3", "f32"), A + "rope.scaling.yarn_ext_factor", T_F32, 7.0, "yarn_ext_factor"),
        ("scale_0", ("tiny", "q8_0"), A + "expert_weights_scale", T_F32, 0.0, "expert_weights_scale"),
        ("scale_neg", ("tiny", "q8_0"), A + "expert_weights_scale", T_F32, -1.0, "expert_weights_scale"),
        ("scale_huge", ("tiny-v3", "q8_0"), A + "expert_weights_scale", T_F32, 1e30, "expert_weights_scale"),
        ("eps_huge", ("tiny", "f32"), A + "attention.layer_norm_rms_epsilon", T_F32, 1e10,
         "layer_norm_rms_epsilon"),
        ("eps_0", ("tiny", "f32"), A + "attention.layer_norm_rms_epsilon", T_F32, 0.0, "layer_norm_rms_epsilon"),
        ("eps_inf", ("tiny", "f32"), A + "attention.layer_norm_rms_epsilon", T_F32, float("inf"),
         "layer_norm_rms_epsilon"),
        # item 9: 2^31-1 layers fail on the first missing layer tensor, not with a bare "out of memory"
        ("block_count_huge", ("tiny", "f32"), A + "block_count", T_U32, 2**31 - 1, "block_count"),
        ("block_count_4", ("tiny", "f32"), A + "block_count", T_U32, 4, "blk.3."),
    ]
    for name, src, key, t, v, needle in hp_cases:
        p = mutant(name, src, lambda g, key=key, t=t, v=v: g.set(key, t, v))
        expect_refused(mt, p, needle, name)
    # gen applies the same rules (moetax_hparams_check) to what it would write
    for opt, val, needle in (("--scale", "0", "expert_weights_scale"), ("--rope-base", "1e-30", "rope.freq_base"),
                             ("--eps", "1e10", "layer_norm_rms_epsilon"), ("--yarn-factor", "-2", "rope.scaling.factor")):
        r = run([mt, "gen", "--preset", "tiny-v3", opt, val, "-o", os.path.join(work, "gen_refused.gguf")])
        sane(r, f"gen {opt} {val}")
        check(r.returncode != 0 and needle in r.stderr, f"gen {opt} {val}: rc {r.returncode}: {r.stderr.strip()}")
    # the first error wins: a NaN freq_base is not reported as a missing rope.scaling.type
    p = os.path.join(work, "freq_base_nan.gguf")
    r = run([mt, "eval", "-m", p, "--tokens", "1"])
    check("rope.scaling.type" not in r.stderr, f"NaN freq_base reported as: {r.stderr.strip()}")

    # --- item 1: ne0 = 2^62 on output_norm (F32): byte size 2^64 wrapped to 0 before
    p = mutant("output_norm_ne0_2e62", ("tiny", "f32"), lambda g: None,
               ne_override={"output_norm.weight": [2**62]})
    expect_refused(mt, p, "tensor 'output_norm.weight': byte size overflows", "output_norm ne0=2^62", load_only=False)
    # a Q8_0 matrix whose rows overflow
    p = mutant("attn_q_ne0_2e62", ("tiny", "q8_0"), lambda g: None,
               ne_override={"blk.0.attn_q.weight": [2**62, 2]})
    expect_refused(mt, p, "blk.0.attn_q.weight", "attn_q ne0=2^62", load_only=False)

    # --- truncated files: in the data section, and in the header
    src = open(base[("tiny", "q8_0")], "rb").read()
    for name, cut in (("truncated_data", len(src) - 100), ("truncated_header", 200)):
        p = os.path.join(work, name + ".gguf")
        open(p, "wb").write(src[:cut])
        expect_refused(mt, p, "past the end" if name == "truncated_data" else "byte", name, load_only=False)

    # --- item 6: general.alignment = 1 with odd offsets is valid GGUF: same logits as the original
    for key in (("tiny", "f32"), ("tiny", "q8_0"), ("tiny-v3", "q8_0")):
        ref = eval_logits(mt, base[key], os.path.join(work, "ref.f32"))

        def align1(g):
            g.set("general.alignment", T_U32, 1)
            g.set("hostile.pad", T_STR, "x")  # an odd header length: the data section starts at an odd byte
        p = mutant(f"align1-{key[0]}-{key[1]}", key, align1, gap=1)
        g = Gguf(p)
        check(g.get("general.alignment") == 1, "align1 file written with alignment 1")
        got = eval_logits(mt, p, os.path.join(work, "align1.f32"))
        check(ref is not None and got == ref, f"alignment 1, odd offsets ({key}): logits differ from the original")
        # the scalar reference kernels too (MOETAX_FORCE_REF=1), which read blocks through typed pointers
        ref_r = eval_logits(mt, base[key], os.path.join(work, "ref_r.f32"), ref_kernels=True)
        got_r = eval_logits(mt, p, os.path.join(work, "align1_r.f32"), ref_kernels=True)
        check(ref_r is not None and got_r == ref_r, f"alignment 1 ({key}), reference kernels: logits differ")
        for name, args in commands(mt, p).items():
            r = run(args)
            sane(r, f"align1 {key}: {name}")
            check(r.returncode == 0, f"align1 {key}: {name}: rc {r.returncode}: {r.stderr.strip()[-600:]}")

    # --- item 9: an unknown tokenizer.ggml.pre is warned about, naming the value
    p = mutant("pre_unknown", ("tiny", "f32"), lambda g: g.set("tokenizer.ggml.pre", T_STR, "mystery-pre"))
    r = run([mt, "run", "-m", p, "-p", "def f(", "-n", "2", "--temp", "0", "-t", "1"])
    sane(r, "tokenizer.ggml.pre mystery-pre")
    check(r.returncode == 0, f"pre mystery-pre: run rc {r.returncode}: {r.stderr[-400:]}")
    check("mystery-pre" in r.stderr and "tokenizer.ggml.pre" in r.stderr,
          f"no warning naming tokenizer.ggml.pre 'mystery-pre': {r.stderr[-400:]}")
    check(r.stderr.count("mystery-pre") == 1, "the warning is printed once")

    # --- item 7: a FIFO as the model path is refused at once, not waited on
    fifo = os.path.join(work, "fifo.gguf")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    for name, args in commands(mt, fifo).items():
        try:
            r = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=20)
        except subprocess.TimeoutExpired:
            check(False, f"fifo: {name} blocked")
            continue
        sane(r, f"fifo: {name}")
        check(r.returncode != 0 and "not a regular file" in r.stderr, f"fifo: {name}: {r.stderr.strip()[-300:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
