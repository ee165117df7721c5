"""Loop-based references for `lctrain diagnose rope`'s Eq. 4 and Eq. 5 (paper §2.2), written from a Hugging Face
Llama model's own eager attention (`output_attentions=True`) and from its own q/k projections and rotary frequencies,
with no lctrain code. Shared by the tiny-model tests (test_diagnose_rope.py) and the real-weights ones
(test_rope_real_weights.py); the head layout comes from the model's config."""

import math

import torch


def eager_attentions(model, ids, shift):
    """[layer][head][i][j] attention weights of the model's eager attention at position ids shift..shift+T-1."""
    with torch.no_grad():
        out = model(ids[None], position_ids=(torch.arange(len(ids)) + shift)[None], output_attentions=True)
    return [a[0].tolist() for a in out.attentions]


def reference_eq4(model, ids, d1, d2):
    """Eq. 4 with explicit loops: D = Σ_l Σ_h Σ_j n_j Σ_i |ATTN_ij(Δ1) − ATTN_ij(Δ2)|, n_j = 1/(L−j+1) for 1-based
    j; also the per-key terms d_j."""
    a1, a2 = eager_attentions(model, ids, d1), eager_attentions(model, ids, d2)
    n = len(ids)
    per_key = [0.0] * n
    for layer in range(len(a1)):
        for head in range(len(a1[layer])):
            for j in range(n):  # 0-based key j: the 1-based j+1, seen by L-(j+1)+1 = n-j queries
                column = 0.0
                for i in range(n):
                    column += abs(a1[layer][head][i][j] - a2[layer][head][i][j])
                per_key[j] += column / (n - j)
    return sum(per_key), per_key


def attention_inputs(model, ids, shift):
    """The hidden states each layer's attention receives (after its input norm), in the eager model at `shift`."""
    seen = []
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["hidden_states"][0].double()), with_kwargs=True
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(ids[None], position_ids=(torch.arange(len(ids)) + shift)[None])
    for h in hooks:
        h.remove()
    return seen


def rope_angles(position, inv_freq):
    """fp32(inv_freq_m · position) for each frequency m, rounded as the model's rotary module rounds it."""
    return [float(torch.tensor(f, dtype=torch.float32) * torch.tensor(float(position))) for f in inv_freq]


def rotated(vec, angles):
    """RoPE on one head vector, Llama's rotate-half pairing (m, m + d/2), cos/sin of `angles` in float64."""
    half = len(vec) // 2
    out = [0.0] * len(vec)
    for m in range(half):
        c, s = math.cos(angles[m]), math.sin(angles[m])
        out[m] = vec[m] * c - vec[m + half] * s
        out[m + half] = vec[m + half] * c + vec[m] * s
    return out


def head_layout(model):
    """(query heads, KV heads, head dimension) from the model's config."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_attention_heads, c.num_key_value_heads, head_dim


def reference_eq5(model, ids, d1, d2):
    """Eq. 5 with explicit loops: (1/T) Σ_l Σ_h Σ_i |A_i1(Δ1) − A_i1(Δ2)|, A_ij = q_i·k_j after the rotation, the
    key the first token, from each layer's own q/k projections (float64)."""
    heads, kv_heads, hd = head_layout(model)
    inv_freq = model.model.rotary_emb.inv_freq.tolist()
    n = len(ids)
    logits = {}
    for shift in (d1, d2):
        angles = [rope_angles(shift + i, inv_freq) for i in range(n)]
        per_layer = []
        for layer, x in zip(model.model.layers, attention_inputs(model, ids, shift)):
            wq = layer.self_attn.q_proj.weight.double()
            wk = layer.self_attn.k_proj.weight.double()
            per_head = []
            for h in range(heads):
                kv = h // (heads // kv_heads)
                k0 = rotated((wk[kv * hd : (kv + 1) * hd] @ x[0]).tolist(), angles[0])
                q = (x @ wq[h * hd : (h + 1) * hd].T).tolist()  # [T, head_dim]: q_i of every query
                row = []
                for i in range(n):
                    qi = rotated(q[i], angles[i])
                    row.append(sum(a * b for a, b in zip(qi, k0)))
                per_head.append(row)
            per_layer.append(per_head)
        logits[shift] = per_layer
    total = 0.0
    for layer in range(len(model.model.layers)):
        for h in range(heads):
            for i in range(n):
                total += abs(logits[d1][layer][h][i] - logits[d2][layer][h][i])
    return total / n
