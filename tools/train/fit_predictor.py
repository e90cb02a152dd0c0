#!/usr/bin/python3
"""Fit the learned expert predictor with a hidden layer (PyTorch), from feature rows.

    ./build/moetax profile -f TRAIN_TEXT -o train.json --dump-features train.feat
    ./build/moetax profile -f HELDOUT_TEXT -o held.json --dump-features held.feat     # optional
    /usr/bin/python3 tools/train/fit_predictor.py train.feat -o P.pred [--heldout held.feat]
    /usr/bin/python3 tools/train/fit_predictor.py --set-margin 0.015 P.pred -o P2.pred  # extra experts, no refit
    ./build/moetax profile -f HELDOUT_TEXT -o h.json --predictor P.pred               # the engine's score

The rows and the predictor file are the formats of include/moetax/predict.h. Per MoE layer l and
distance a (target T, the a-th MoE layer after l) it fits

    z = W f + W2 relu(W1 f + b1),  f = [norm(h_l) g_T ; norm(h_T(prev)) g_T ; onehot(sel_l) ; gate(z_l) ; 1]

to T's router logits (squared error): W first by ridge regression towards T's router (as
`profile --fit-predictor` does in C), then W, W1, b1, W2 together by Adam. The experts are
selected from z by T's own rules, as the engine does. --hidden 0 writes the ridge map alone.
With --heldout, the held-out rows are scored after each epoch (top-k overlap, the same count
`profile --predictor` gives for one token at a time) and at the end for each --margins value
(extra experts by confidence: precision and recall apart).
"""
import argparse
import os
import struct
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "ref"))
import gguf_np  # noqa: E402  (FNV-1a 64, the same checksum the engine checks)

FEAT_CUR, FEAT_PREV, FEAT_ROUTE = 1, 2, 4
HEADER = 128
PAIR_HEADER = 16


class FeatureFile:
    """The rows `moetax profile --dump-features` wrote (include/moetax/predict.h)."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8 + 4 * 10 + 64)
            if len(head) < 112 or head[:8] != b"MTXFEAT\0":
                raise SystemExit("%s: not a moetax feature file (expected \"MTXFEAT\")" % path)
            (ver, self.n_layer, self.d, self.E, self.k, self.gating, self.n_group, self.n_group_used,
             self.n_moe) = struct.unpack("<9I", head[8:44])
            self.eps = struct.unpack("<f", head[44:48])[0]
            self.model = head[48:112].split(b"\0")[0].decode("utf-8", "replace")
            if ver != 1:
                raise SystemExit("%s: feature file version %d, expected 1" % (path, ver))
            if not (1 <= self.n_moe <= self.n_layer <= 4096 and 1 <= self.d <= 65536 and 1 <= self.k <= self.E <= 65536):
                raise SystemExit("%s: header out of range" % path)
            per = 4 + 4 * (self.d + self.E * self.d + self.E)
            off = 112
            self.moe, self.norm, self.router, self.bias = [], {}, {}, {}
            for _ in range(self.n_moe):
                f.seek(off)
                b = np.frombuffer(f.read(per), dtype="<f4")
                if b.size * 4 != per:
                    raise SystemExit("%s: truncated layer table" % path)
                layer = int(b[:1].view("<u4")[0])
                if layer >= self.n_layer or (self.moe and layer <= self.moe[-1]):
                    raise SystemExit("%s: layer table: layer %d out of order" % (path, layer))
                self.moe.append(layer)
                self.norm[layer] = b[1:1 + self.d].copy()
                self.router[layer] = b[1 + self.d:1 + self.d + self.E * self.d].reshape(self.E, self.d).copy()
                self.bias[layer] = b[1 + self.d + self.E * self.d:].copy()
                off += per
        self.rec = np.dtype([("hd", "<i4", 4), ("x", "<f4", self.d), ("z", "<f4", self.E), ("sel", "<i4", self.k)])
        if (size - off) % self.rec.itemsize:
            raise SystemExit("%s: %d bytes of rows are not whole records of %d" % (path, size - off, self.rec.itemsize))
        self.rows = np.memmap(path, dtype=self.rec, mode="r", offset=off)
        lay = np.asarray(self.rows["hd"][:, 0])
        self.idx = {l: np.nonzero(lay == l)[0] for l in self.moe}
        n = {len(v) for v in self.idx.values()}
        if len(n) != 1:
            raise SystemExit("%s: the MoE layers have different row counts %s" % (path, sorted(n)))
        self.n = n.pop()
        self._prev = {}

    def layer(self, l, field, lo=0, hi=None):
        return np.asarray(self.rows[field][self.idx[l][lo:hi]])

    def prev(self, l):
        """For each row of layer l, the index of the same sequence's previous token's row (the
        most recent row of (seq, pos - 1)), -1 if none."""
        if l not in self._prev:
            hd = self.layer(l, "hd")
            last, out = {}, np.full(len(hd), -1, np.int64)
            for i, (s, p) in enumerate(zip(hd[:, 1].tolist(), hd[:, 2].tolist())):
                out[i] = last.get((s, p - 1), -1)
                last[(s, p)] = i
            self._prev[l] = out
        return self._prev[l]


def rmsnorm(x, w, eps):
    x = x.astype(np.float32)
    return x / np.sqrt((x * x).mean(1, keepdims=True) + eps) * w


def gate(z, gating):
    z = torch.as_tensor(z, dtype=torch.float32)
    return torch.sigmoid(z) if gating == 2 else torch.softmax(z, dim=1)


def features(ff, l, T, feat, lo=0, hi=None):
    hi = ff.n if hi is None else hi
    out = [rmsnorm(ff.layer(l, "x", lo, hi), ff.norm[T], ff.eps)]
    if feat & FEAT_PREV:
        pv = ff.prev(T)[lo:hi]
        v = np.zeros((hi - lo, ff.d), np.float32)
        ok = pv >= 0
        if ok.any():
            v[ok] = rmsnorm(np.asarray(ff.rows["x"][ff.idx[T][pv[ok]]]), ff.norm[T], ff.eps)
        out.append(v)
    if feat & FEAT_ROUTE:
        oh = np.zeros((hi - lo, ff.E), np.float32)
        np.put_along_axis(oh, ff.layer(l, "sel", lo, hi).astype(np.int64), 1.0, axis=1)
        out += [oh, gate(ff.layer(l, "z", lo, hi), ff.gating).numpy()]
    out.append(np.ones((hi - lo, 1), np.float32))
    return np.concatenate(out, 1)


def select(ff, T, z, margin=0.0):
    """Experts of T from logits z [n][E] by its rules, [n][k]; with margin > 0 also a mask
    [n][E] of the extra experts (of the groups the rule keeps, within margin of the k-th's
    score, at most k)."""
    sc = gate(z, ff.gating) + torch.as_tensor(ff.bias[T])
    n, E = sc.shape
    s = sc.clone()
    if ff.n_group > 1 and E % ff.n_group == 0:
        g = s.view(n, ff.n_group, -1).topk(2, dim=2).values.sum(2)
        keep = torch.zeros(n, ff.n_group, dtype=torch.bool)
        keep.scatter_(1, g.topk(ff.n_group_used, dim=1).indices, True)
        s = s.view(n, ff.n_group, -1).masked_fill(~keep[:, :, None], -float("inf")).view(n, E)
    top = s.topk(ff.k, dim=1)
    if not margin > 0:
        return top.indices, None
    kth = top.values[:, -1:]
    u = s.scatter(1, top.indices, -float("inf"))
    cand = u >= kth - margin
    rank = torch.argsort(torch.argsort(-u, dim=1), dim=1)  # 0 = best remaining
    return top.indices, cand & (rank < ff.k)


def scores(ff, T, z, margin=0.0):
    """(hits, predicted, actual) against T's true experts."""
    top, extra = select(ff, T, z, margin)
    act = torch.zeros(z.shape[0], ff.E, dtype=torch.bool)
    act.scatter_(1, torch.as_tensor(ff.layer(T, "sel").astype(np.int64)), True)
    pred = torch.zeros_like(act)
    pred.scatter_(1, top, True)
    if extra is not None:
        pred |= extra
    return int((pred & act).sum()), int(pred.sum()), int(act.sum())


def ridge(ff, l, T, feat, lam, chunk=100000):
    F = None
    for lo in range(0, ff.n, chunk):
        hi = min(ff.n, lo + chunk)
        X = torch.as_tensor(features(ff, l, T, feat, lo, hi), dtype=torch.float64)
        Y = torch.as_tensor(ff.layer(T, "z", lo, hi), dtype=torch.float64)
        if F is None:
            F = X.shape[1]
            A, B = X.T @ X, X.T @ Y
        else:
            A += X.T @ X
            B += X.T @ Y
    m = float(torch.diagonal(A).mean())
    r = torch.full((F,), lam * m + 1e-9 * (m if m > 0 else 1), dtype=torch.float64)
    r[-1] = 1e-9 * (m if m > 0 else 1)  # the bias column is not pulled
    W0 = torch.zeros(F, ff.E, dtype=torch.float64)
    W0[:ff.d] = torch.as_tensor(ff.router[T].T, dtype=torch.float64)
    return torch.linalg.solve(A + torch.diag(r), B + r[:, None] * W0).T.float()  # [E][F]


def fit_pair(ff, held, l, T, a, args, log):
    W = ridge(ff, l, T, args.features, args.lam)
    Xh = torch.as_tensor(features(held, l, T, args.features)) if held else None
    if Xh is not None:
        h, p, _ = scores(held, T, Xh @ W.T)
        log("  layer %d -> %d: ridge %.1f%%" % (l, T, 100 * h / p))
    H = args.hidden
    if not H:
        return W, None, None, None
    torch.manual_seed(args.seed + 1000 * l + a)
    N = ff.n if not args.max_rows else min(ff.n, args.max_rows)
    X = torch.as_tensor(features(ff, l, T, args.features, 0, N))
    Y = torch.as_tensor(ff.layer(T, "z", 0, N))
    F = X.shape[1]
    lin = torch.nn.Linear(F, ff.E, bias=False)
    hid = torch.nn.Linear(F, H)
    out = torch.nn.Linear(H, ff.E, bias=False)
    with torch.no_grad():
        lin.weight.copy_(W)
        out.weight.mul_(0.1)
    params = list(lin.parameters()) + list(hid.parameters()) + list(out.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    bs = args.batch
    steps = args.epochs * (N // bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(1, steps))

    def fwd(x):
        return lin(x) + out(torch.relu(hid(x)))

    t0 = time.time()
    for e in range(args.epochs):
        perm = torch.randperm(N)
        tot = 0.0
        for i in range(0, N - bs + 1, bs):
            j = perm[i:i + bs]
            loss = ((fwd(X[j]) - Y[j]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += float(loss)
        msg = "  layer %d -> %d: epoch %d, loss %.4f" % (l, T, e + 1, tot / max(1, N // bs))
        if Xh is not None:
            with torch.no_grad():
                h, p, _ = scores(held, T, fwd(Xh))
            msg += ", held-out %.1f%%" % (100 * h / p)
        log(msg + " (%.0f s)" % (time.time() - t0))
    return (lin.weight.detach().clone(), hid.weight.detach().clone(), hid.bias.detach().clone(),
            out.weight.detach().clone())


def write(path, ff, pairs, args, tokens):
    """The predictor file, version 2 (include/moetax/predict.h)."""
    F = ff.d * (2 if args.features & FEAT_PREV else 1) + (2 * ff.E if args.features & FEAT_ROUTE else 0) + 1
    h = bytearray(HEADER)
    h[0:8] = b"MTXPRED\0"
    struct.pack_into("<10I", h, 8, 2, ff.n_layer, ff.d, ff.E, ff.k, args.ahead, args.features, F, len(pairs),
                     args.hidden)
    struct.pack_into("<Qff", h, 48, tokens, args.lam, args.margin)
    name = os.path.basename(ff.model).encode()[:63]
    h[64:64 + len(name)] = name
    body = [bytes(h)]
    for (l, a, T), (W, W1, b1, W2) in pairs:
        body.append(struct.pack("<4I", l, a, T, 0))
        for t in (W, W1, b1, W2):
            if t is not None:
                v = t.numpy().astype("<f4")
                if not np.isfinite(v).all():
                    raise SystemExit("layer %d -> %d: the fit is not finite" % (l, T))
                body.append(v.tobytes())
    data = b"".join(body)
    data += struct.pack("<Q", gguf_np.fnv1a64(data))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def set_margin(src, dst, margin):
    """A copy of predictor file src with another margin (version 2; the checksum redone)."""
    with open(src, "rb") as f:
        data = bytearray(f.read())
    if len(data) < HEADER + 8 or data[:8] != b"MTXPRED\0" or struct.unpack_from("<I", data, 8)[0] != 2:
        raise SystemExit("%s: not a version 2 moetax predictor" % src)
    if gguf_np.fnv1a64(bytes(data[:-8])) != struct.unpack_from("<Q", data, len(data) - 8)[0]:
        raise SystemExit("%s: checksum mismatch: the file is damaged" % src)
    struct.pack_into("<f", data, 60, margin)
    data[-8:] = struct.pack("<Q", gguf_np.fnv1a64(bytes(data[:-8])))
    tmp = dst + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--set-margin":
        ap = argparse.ArgumentParser(prog="fit_predictor.py --set-margin",
                                     description="copy a predictor file with another margin (no refit)")
        ap.add_argument("margin", type=float)
        ap.add_argument("predictor")
        ap.add_argument("-o", "--output", required=True)
        a = ap.parse_args(sys.argv[2:])
        if not a.margin >= 0 or a.margin != a.margin or a.margin == float("inf"):
            raise SystemExit("fit_predictor: --set-margin: a finite number >= 0")
        set_margin(a.predictor, a.output, a.margin)
        print("fit_predictor: %s: margin %g" % (a.output, a.margin))
        return
    ap = argparse.ArgumentParser(description="fit the learned expert predictor (a hidden layer) from feature rows")
    ap.add_argument("features_file", help="rows from `moetax profile --dump-features`")
    ap.add_argument("-o", "--output", required=True, help="the predictor file to write")
    ap.add_argument("--heldout", help="rows of other text, scored after each epoch")
    ap.add_argument("--hidden", type=int, default=256, help="hidden width (0: the ridge map alone; default 256)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's peak learning rate (one cycle)")
    ap.add_argument("--lambda", dest="lam", type=float, default=0.1, help="ridge strength, as --predictor-lambda")
    ap.add_argument("--ahead", type=int, default=1, choices=(1, 2))
    ap.add_argument("--no-prev", action="store_true", help="without the previous token's residual")
    ap.add_argument("--no-route", action="store_true", help="without the current layer's routing")
    ap.add_argument("--margin", type=float, default=0.0, help="extra experts within this score of the k-th (file)")
    ap.add_argument("--margins", default="", help="held-out precision/recall at these margins, e.g. 0.02,0.05")
    ap.add_argument("--max-rows", type=int, default=0, help="train the hidden layer on the first N rows only")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if not 0 <= args.hidden <= 4096 or args.epochs < 0 or args.batch < 1 or args.margin < 0 or args.lam < 0:
        raise SystemExit("fit_predictor: --hidden 0..4096, --epochs >= 0, --batch >= 1, --margin and --lambda >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.features = FEAT_CUR | (0 if args.no_prev else FEAT_PREV) | (0 if args.no_route else FEAT_ROUTE)

    def log(msg):
        print(msg, flush=True)

    ff = FeatureFile(args.features_file)
    held = FeatureFile(args.heldout) if args.heldout else None
    if held and (held.d, held.E, held.k, held.moe) != (ff.d, ff.E, ff.k, ff.moe):
        raise SystemExit("%s: another model's rows than %s" % (args.heldout, args.features_file))
    log("fit_predictor: %d tokens x %d MoE layers (%s), hidden %d, features %d" % (
        ff.n, len(ff.moe), ff.model, args.hidden, args.features))
    pairs = []
    for i, l in enumerate(ff.moe):
        for a in range(1, args.ahead + 1):
            if i + a < len(ff.moe):
                T = ff.moe[i + a]
                pairs.append(((l, a, T), fit_pair(ff, held, l, T, a, args, log)))
    n = write(args.output, ff, pairs, args, ff.n)
    log("fit_predictor: %s (%d bytes)" % (args.output, n))
    if held:
        margins = [args.margin] + [float(m) for m in args.margins.split(",") if m]
        for a in range(1, args.ahead + 1):
            for mg in margins:
                th = tp = ta = 0
                for (l, aa, T), (W, W1, b1, W2) in pairs:
                    if aa != a:
                        continue
                    X = torch.as_tensor(features(held, l, T, args.features))
                    with torch.no_grad():
                        z = X @ W.T + (torch.relu(X @ W1.T + b1) @ W2.T if W1 is not None else 0)
                    h, p, t = scores(held, T, z, mg)
                    th, tp, ta = th + h, tp + p, ta + t
                log("held-out, %d ahead, margin %g: precision %.1f%%, recall %.1f%%, %.2f experts per token" % (
                    a, mg, 100 * th / tp, 100 * th / ta, tp / (held.n * sum(1 for q in pairs if q[0][1] == a))))


if __name__ == "__main__":
    main()
