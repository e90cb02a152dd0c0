#!/usr/bin/python3
"""Train the default model: tokenizer, then the MoE, on Debian's Python standard library.

    /usr/bin/python3 tools/train/train.py --out work/train          # the full run (see README)
    /usr/bin/python3 tools/train/train.py --out /tmp/t --steps 3    # a smoke run

Everything is a function of --seed: the corpus split (by path), the tokenizer (deterministic
merges), the initial weights, the batch order. The work folder receives tokenizer.json,
tokens_{train,heldout}.npy, ckpt.pt (every --ckpt-every steps and at the end) and log.jsonl
(one line per step: loss, tokens/s, expert load imbalance, held-out loss when evaluated).
A run that stops can be resumed with --resume (same arguments).
"""
import argparse
import json
import math
import os
import sys
import time

# libgomp's spinning workers would take the cores from OpenBLAS's own threads (measured:
# 14 s per default step with spinning, 8 s without); set before torch loads libgomp
os.environ.setdefault("GOMP_SPINCOUNT", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe      # noqa: E402
import corpus   # noqa: E402
from model import DEFAULT_CONFIG, Model   # noqa: E402


def build_data(out, vocab, roots, log):
    tok_path = os.path.join(out, "tokenizer.json")
    tr_path, he_path = os.path.join(out, "tokens_train.npy"), os.path.join(out, "tokens_heldout.npy")
    train, held = corpus.split(roots)
    if not os.path.exists(tok_path):
        t0 = time.time()
        merges = bpe.train([t for _, t in train], vocab)
        bpe.Tokenizer(merges).save(tok_path)
        log("tokenizer: %d merges in %.1f s" % (len(merges), time.time() - t0))
    tok = bpe.Tokenizer.load(tok_path)
    if not (os.path.exists(tr_path) and os.path.exists(he_path)):
        for path, files in ((tr_path, train), (he_path, held)):
            ids = []
            for _, text in files:
                ids.append(tok.eot)
                ids.extend(tok.encode(text))
            np.save(path, np.asarray(ids, dtype=np.int16 if tok.n_vocab < 32768 else np.int32))
    tr, he = np.load(tr_path).astype(np.int64), np.load(he_path).astype(np.int64)
    log("corpus: %d train files, %d tokens; %d held-out files, %d tokens" % (len(train), len(tr), len(held), len(he)))
    return tok, torch.from_numpy(tr), torch.from_numpy(he)


@torch.no_grad()
def heldout_loss(model, he, seq, n_windows):
    model.eval()
    step = max(1, (len(he) - seq - 1) // n_windows)
    losses = []
    for i in range(n_windows):
        w = he[i * step:i * step + seq + 1]
        if len(w) < seq + 1:
            break
        logits = model(w[None, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits[0], w[1:]).item())
    model.train()
    return float(np.mean(losses))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work folder")
    ap.add_argument("--root", action="append", help="corpus root (default /usr/lib/python3.11)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--balance-rate", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--config", help="JSON object overriding model config keys")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(a.threads)
    logf = open(os.path.join(a.out, "log.jsonl"), "a")

    def log(msg, **kv):
        print(msg, flush=True)
        logf.write(json.dumps(dict(msg=msg, time=time.time(), **kv)) + "\n")
        logf.flush()

    cfg = dict(DEFAULT_CONFIG)
    if a.config:
        cfg.update(json.loads(a.config))
    tok, tr, he = build_data(a.out, cfg["vocab"], a.root, log)
    if tok.n_vocab != cfg["vocab"]:
        raise SystemExit("tokenizer has %d tokens, config wants %d" % (tok.n_vocab, cfg["vocab"]))
    torch.manual_seed(a.seed)
    model = Model(cfg)
    model.init_weights(a.seed)
    total, active = model.n_params()
    log("model: %.2f M parameters, %.2f M active per token" % (total / 1e6, active / 1e6), total=total, active=active)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "embd"]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "embd")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    step0 = 0
    ckpt = os.path.join(a.out, "ckpt.pt")
    gen = torch.Generator().manual_seed(a.seed + 1)
    if a.resume and os.path.exists(ckpt):
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step0 = st["step"]
        log("resumed at step %d" % step0)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        f = (s - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))

    def save(step):
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                    "step": step, "config": cfg, "seed": a.seed, "seq": a.seq}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)

    n = len(tr) - a.seq - 1
    t_start = time.time()
    model.train()
    for step in range(step0, a.steps):
        t0 = time.time()
        starts = torch.randint(0, n, (a.batch,), generator=gen)
        x = torch.stack([tr[s:s + a.seq + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        imb = []
        for m in model.moe_layers():
            imb.append((m.last_load.max().item() / max(1e-9, m.last_load.float().mean().item())))
            m.balance(a.balance_rate)
        dt = time.time() - t0
        rec = dict(step=step + 1, loss=loss.item(), lr=lr_at(step), gnorm=gnorm, tok_s=a.batch * a.seq / dt,
                   max_load_over_mean=float(np.mean(imb)), elapsed=time.time() - t_start)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            rec["heldout_loss"] = heldout_loss(model, he, a.seq, 16)
        log("step %d/%d loss %.3f%s %.0f tok/s imb %.2f" % (
            step + 1, a.steps, rec["loss"], " heldout %.3f" % rec["heldout_loss"] if "heldout_loss" in rec else "",
            rec["tok_s"], rec["max_load_over_mean"]), **rec)
        if (step + 1) % a.ckpt_every == 0 or step + 1 == a.steps:
            save(step + 1)
    log("done: %d steps in %.0f s" % (a.steps - step0, time.time() - t_start))


if __name__ == "__main__":
    main()
