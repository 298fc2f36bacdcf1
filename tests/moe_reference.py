"""Straightforward references for MoE tests, sharing no code with fusion.moe: per-token Python routing and a
plain PyTorch MoE (topk-style choice + loop over experts + index_add)."""
import torch


def ref_route(logits, k, score="softmax", bias=None, normalize=True, round_to=None):
    """Per-token Python routing. Returns (index, expert, probs, group_sizes) as Python lists plus probs as a
    tensor built from differentiable scalars (so gradients can be compared)."""
    T, E = logits.shape
    z = logits.double()
    s = torch.softmax(z, -1) if score == "softmax" else torch.sigmoid(z)
    sel = s.detach() + (0 if bias is None else bias.double())
    chosen, norm = [], []
    for t in range(T):
        order = sorted(range(E), key=lambda e: (-float(sel[t, e]), e))[:k]
        chosen.append(order)
        norm.append(s[t, order].sum() if normalize else None)

    def prob(t, e):
        return s[t, e] / norm[t] if normalize else s[t, e]

    per_expert = []
    for e in range(E):
        rows = [t for t in range(T) if e in chosen[t]]
        if round_to:
            c = len(rows)
            q, r = divmod(c, round_to)
            n = min((q + (1 if 2 * r >= round_to else 0)) * round_to, T)
            if n < c:
                ranked = sorted(rows, key=lambda t: (-float(prob(t, e).detach()), t))
                rows = sorted(ranked[:n])
            elif n > c:
                others = sorted((t for t in range(T) if t not in rows), key=lambda t: (-float(prob(t, e).detach()), t))
                rows = sorted(rows + others[:n - c])
        per_expert.append(rows)
    index = [t for rows in per_expert for t in rows]
    expert = [e for e, rows in enumerate(per_expert) for _ in rows]
    probs = [prob(t, e) for e, rows in enumerate(per_expert) for t in rows]
    sizes = [len(rows) for rows in per_expert]
    if round_to:
        pad = T * k + E * (round_to // 2) - len(index)
        assert pad >= 0
        index, expert = index + [-1] * pad, expert + [-1] * pad
        probs = probs + [s.new_zeros(())] * pad
    return index, expert, torch.stack(probs) if probs else s.new_zeros(0), sizes


def plain_moe(x, router_w, w1, w2, k, score="softmax", normalize=True, round_to=None, bias=None):
    """y (T, d) of a SwiGLU MoE: routing by ref_route, then a loop over experts with index_add (float64)."""
    logits = x @ router_w.T
    index, expert, probs, _ = ref_route(logits, k, score, bias, normalize, round_to)
    index, expert = torch.tensor(index), torch.tensor(expert)
    y = torch.zeros_like(x)
    f = w2.shape[2]
    for e in range(w1.shape[0]):
        rows = (expert == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        tok = index[rows]
        h = x[tok] @ w1[e].T
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
        y = y.index_add(0, tok, (a @ w2[e].T) * probs[rows, None])
    return y
