"""A DeepSeek-V3-style MoE in PyTorch: the default model's training code and a second,
independent reference for moetax's forward pass.

Architecture (the llama.cpp `deepseek2` graph, written here from the papers' definitions):
  - token embedding; n_layer blocks x -> x + MLA(rmsnorm(x)); x -> x + FFN(rmsnorm(x)); rmsnorm; output.
  - MLA without a query low-rank (q_lora_rank 0, as DeepSeek-V2-Lite): per head a query of
    nope + rope dims; a shared latent c = rmsnorm(W_kv_a x)[:kv_lora] and one RoPE key
    k_pe = W_kv_a x [kv_lora:]; per head k_nope, v from W_kv_b c; RoPE on adjacent pairs
    (ggml's NORM mode); scale 1/sqrt(nope + rope); causal softmax.
  - the first n_dense blocks use a dense SiLU-gated FFN; the others a routed MoE with shared
    experts: sigmoid scores s = sigmoid(W_g x); experts chosen by s + b (b: per-expert bias,
    not trained by gradient but nudged after each step towards equal load, DeepSeek-V3's
    auxiliary-loss-free balancing) restricted to the best n_group_used of n_group groups
    (a group's score is the sum of its two best biased scores); the chosen experts are
    weighted by their unbiased scores normalized to sum 1, times `scale`.

The parameter names below map one to one onto GGUF tensors (see export.py).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


DEFAULT_CONFIG = dict(
    vocab=4096, d=256, n_layer=6, n_dense=1, n_ff=768, n_head=8, nope=32, rope=16, v_head=32,
    kv_lora=64, n_expert=32, expert_ff=128, k=4, n_shared=2, n_group=4, n_group_used=2,
    scale=2.5, eps=1e-6, rope_base=10000.0, ctx=1024)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_adjacent(x, pos, base):
    """RoPE on adjacent pairs (x0, x1), (x2, x3), ... of the last axis. x (..., S, n), pos (S,)."""
    n = x.shape[-1]
    inv = base ** (-torch.arange(0, n, 2, dtype=torch.float64) / n)
    th = pos.to(torch.float64)[:, None] * inv[None, :]                 # (S, n/2)
    c, s = torch.cos(th).to(x.dtype), torch.sin(th).to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


class MLA(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        H, nope, rope, vh, kvl, d = c["n_head"], c["nope"], c["rope"], c["v_head"], c["kv_lora"], c["d"]
        self.wq = nn.Parameter(torch.empty(H * (nope + rope), d))
        self.wkv_a = nn.Parameter(torch.empty(kvl + rope, d))
        self.kv_norm = nn.Parameter(torch.ones(kvl))
        self.wkv_b = nn.Parameter(torch.empty(H * (nope + vh), kvl))     # HF kv_b_proj layout
        self.wo = nn.Parameter(torch.empty(d, H * vh))

    def forward(self, x, pos):
        c = self.c
        B, S, _ = x.shape
        H, nope, rope, vh, kvl = c["n_head"], c["nope"], c["rope"], c["v_head"], c["kv_lora"]
        q = (x @ self.wq.t()).view(B, S, H, nope + rope).transpose(1, 2)        # (B, H, S, nope+rope)
        q_nope, q_pe = q[..., :nope], rope_adjacent(q[..., nope:], pos, c["rope_base"])
        kva = x @ self.wkv_a.t()
        lat = rmsnorm(kva[..., :kvl], self.kv_norm, c["eps"])
        k_pe = rope_adjacent(kva[..., kvl:], pos, c["rope_base"])[:, None]     # (B, 1, S, rope)
        kv = (lat @ self.wkv_b.t()).view(B, S, H, nope + vh).transpose(1, 2)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        scores = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) / math.sqrt(nope + rope)
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        o = (p @ v).transpose(1, 2).reshape(B, S, H * vh)
        return o @ self.wo.t()


class DenseFFN(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(ff, d))
        self.up = nn.Parameter(torch.empty(ff, d))
        self.down = nn.Parameter(torch.empty(d, ff))

    def forward(self, x):
        return (F.silu(x @ self.gate.t()) * (x @ self.up.t())) @ self.down.t()


def route(s, bias, c):
    """Expert choice for scores s (T, E). Returns (idx (T, k), weights (T, k))."""
    E, G, Gu, k = c["n_expert"], c["n_group"], c["n_group_used"], c["k"]
    sel = s.detach() + bias
    if G > 1:
        g = sel.view(-1, G, E // G)
        gs = g.topk(2, dim=-1).values.sum(-1)                                   # (T, G)
        keep = gs.topk(Gu, dim=-1).indices
        gmask = torch.ones_like(gs, dtype=torch.bool).scatter_(1, keep, False)
        sel = g.masked_fill(gmask[..., None], float("-inf")).view(-1, E)
    idx = sel.topk(k, dim=-1).indices
    w = s.gather(1, idx)
    w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5) * c["scale"]
    return idx, w


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        E, d, f = c["n_expert"], c["d"], c["expert_ff"]
        self.gate_inp = nn.Parameter(torch.empty(E, d))
        self.register_buffer("bias", torch.zeros(E))
        self.gate = nn.Parameter(torch.empty(E, f, d))
        self.up = nn.Parameter(torch.empty(E, f, d))
        self.down = nn.Parameter(torch.empty(E, d, f))
        self.shared = DenseFFN(d, f * c["n_shared"])
        self.last_load = None
        self.last_idx = None

    def forward(self, x):
        c = self.c
        B, S, d = x.shape
        xt = x.reshape(-1, d)
        s = torch.sigmoid(xt @ self.gate_inp.t())
        idx, w = route(s, self.bias, c)
        self.last_idx = idx.detach()
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // c["k"]
        counts = torch.bincount(flat, minlength=c["n_expert"])
        self.last_load = counts.detach()
        xs = xt[tok]
        ys = []
        # unbind once: indexing the stacked weights per expert would make autograd
        # accumulate a full-size gradient per expert
        wg, wu, wd = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        for e, chunk in enumerate(xs.split(counts.tolist())):
            if chunk.shape[0] == 0:
                continue
            h = F.silu(chunk @ wg[e].t()) * (chunk @ wu[e].t())
            ys.append(h @ wd[e].t())
        y = torch.cat(ys) * w.reshape(-1)[order][:, None]
        out = torch.zeros_like(xt).index_add_(0, tok, y)
        return (out + self.shared(xt)).view(B, S, d)

    @torch.no_grad()
    def balance(self, rate):
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
        load = self.last_load.float()
        self.bias += rate * torch.sign(load.mean() - load)


class Block(nn.Module):
    def __init__(self, c, il):
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(c["d"]))
        self.attn = MLA(c)
        self.ffn_norm = nn.Parameter(torch.ones(c["d"]))
        self.ffn = DenseFFN(c["d"], c["n_ff"]) if il < c["n_dense"] else MoE(c)
        self.eps = c["eps"]

    def forward(self, x, pos):
        x = x + self.attn(rmsnorm(x, self.attn_norm, self.eps), pos)
        return x + self.ffn(rmsnorm(x, self.ffn_norm, self.eps))


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = dict(c)
        self.embd = nn.Parameter(torch.empty(c["vocab"], c["d"]))
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c["n_layer"])])
        self.out_norm = nn.Parameter(torch.ones(c["d"]))
        self.out = nn.Parameter(torch.empty(c["vocab"], c["d"]))

    def init_weights(self, seed):
        g = torch.Generator().manual_seed(seed)
        resid = 1.0 / math.sqrt(2 * self.c["n_layer"])
        for name, p in self.named_parameters():
            if name.endswith("norm") or p.dim() == 1:
                continue
            fan_in = p.shape[-1]
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith(("wo", "down")):
                std *= resid
            if name == "embd":
                std = 1.0
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def moe_layers(self):
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def forward(self, tokens, pos0=0):
        """tokens (B, S) int64 -> logits (B, S, vocab)."""
        S = tokens.shape[1]
        pos = torch.arange(pos0, pos0 + S)
        x = self.embd[tokens]
        for b in self.blocks:
            x = b(x, pos)
        return rmsnorm(x, self.out_norm, self.c["eps"]) @ self.out.t()

    def n_params(self):
        """(total, active per token): routed experts counted at k of n_expert, one embedding row."""
        c = self.c
        total = sum(p.numel() for p in self.parameters())
        routed = sum(m.gate.numel() + m.up.numel() + m.down.numel() for m in self.moe_layers())
        active = total - routed + routed * c["k"] // c["n_expert"] - self.embd.numel() + c["d"]
        return total, active
