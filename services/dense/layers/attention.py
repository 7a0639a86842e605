"""Attention variants: grouped-query (GQA) and multi-head latent (MLA).

A step may carry several sequences: projections run over all T tokens at once, then each sequence's
rows attend to its own cache (a Segment: its rows, its layer cache, its causal mask).
Shapes: T new tokens, S cached positions (T included), D hidden size, H query heads,
Hkv key/value heads, Dh head size, C kv_lora_rank, N/R/V the MLA nope, rope and value head sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.model_config import ModelConfig
from services.dense.kv_cache import Segment
from services.dense.layers.norm import rms_norm
from services.dense.layers.rope import Rotary
from services.dense.weights import WeightLoader

from services.dense.layers.native_ops import tandem_native as _native


# Up to this many new tokens of a sequence, MLA attends over the cached latent directly (absorbed),
# and grouped-query attention over the cached heads as they are (_attend_grouped).
ABSORB_MAX_TOKENS = 16
GROUPED_MAX_TOKENS = 16


def _native_attend(q, k, v, mask, scale: float, sinks: torch.Tensor | None, pool, q2=None, k2=None, q_up=None,
                   v_up=None) -> torch.Tensor | None:
    """float32 attention on the CPU in one native call on the dense linears' pool (torch's grouped
    path is about twenty small ops a layer, most of a decode step's attention), for chunks of every
    length: each token's heads are computed on their own, so a prompt token's result is the same in
    whichever chunk it arrives (chunked prefill keeps batched == alone). q2 [T, H, D2] and k2 [S, Hkv,
    D2]: a second part of each query and key (each logit q . k + q2 . k2); q_up [H, Dn, Dq]: q holds
    Dn values a head, its query q[t, h] q_up[h]; v_up [H, Do, Dv]: a head's output is v_up[h] times its
    weighted values ([T, H * Do]). None where it does not apply: no pool (float linears: torch has the
    cores), another dtype or device."""
    parts = [x for x in (q, k, v, q2, k2, q_up, v_up) if x is not None]
    if pool is None or q.device.type != "cpu" or not all(t.dtype == torch.float32 for t in parts):
        return None
    out = torch.empty((q.shape[0], q.shape[1] * (v.shape[2] if v_up is None else v_up.shape[1])), dtype=torch.float32)
    extra = [None if x is None else x.detach().contiguous().numpy() for x in (q2, k2, q_up, v_up)]
    _native.attend(q.detach().numpy(), k.detach().contiguous().numpy(), v.detach().contiguous().numpy(),
                   mask.contiguous().numpy(), scale, None if sinks is None else sinks.detach().numpy(), out.numpy(), pool,
                   *extra)
    return out


def _attend_with_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor, pool=None) -> torch.Tensor:
    """As _attend, with sinks [H]: each head's learned logit joins its softmax as one more key with
    no value, and takes its share of the probability away (gpt-oss)."""
    out = _native_attend(q, k, v, mask, scale, sinks, pool)
    if out is not None:
        return out
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, S]
    logits = logits.masked_fill(~mask[None], float("-inf"))
    sink = sinks.to(logits.dtype)[:, None, None].expand(-1, q.shape[0], 1)  # [H, T, 1]
    combined = torch.cat((logits, sink), dim=-1)
    probs = (combined - combined.max(dim=-1, keepdim=True).values).softmax(dim=-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs.to(v.dtype), v).reshape(q.shape[0], -1)


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """_attend for a few new tokens: each key/value head's group of query heads against the cache
    as it is (torch's own attention repeats every cached key and value per query head first, which
    costs a decode step more than the attention itself). g = H / Hkv."""
    t, h, dq = q.shape
    s, hkv, dv = v.shape
    g = h // hkv
    qg = q.view(t, hkv, g, dq).permute(1, 2, 0, 3).reshape(hkv, g * t, dq)  # [Hkv, g * T, Dq]
    logits = (torch.bmm(qg, k.permute(1, 2, 0)) * scale).view(hkv, g, t, s)  # [Hkv, g, T, S]
    logits = logits.masked_fill(~mask, float("-inf")).view(hkv, g * t, s)
    out = torch.bmm(logits.softmax(dim=-1).to(v.dtype), v.transpose(0, 1))  # [Hkv, g * T, Dv]
    return out.view(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, h * dv)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, pool=None) -> torch.Tensor:
    """q [T, H, Dq], k [S, Hkv, Dq], v [S, Hkv, Dv], mask [T, S] bool -> [T, H * Dv]; pool: the native
    pool a few float32 tokens may attend on."""
    out = _native_attend(q, k, v, mask, scale, None, pool)
    if out is not None:
        return out
    if q.shape[0] <= GROUPED_MAX_TOKENS:
        return _attend_grouped(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


class GQAttention:
    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str, rotary: Rotary):
        a, d = cfg.attention, cfg.hidden_size
        self.a, self.eps, self.rotary, self.pool = a, cfg.rms_norm_eps, rotary, w.pool
        self.sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        self.qkv_proj = w.linears([f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")], self.sizes, d, a.qkv_bias)
        self.o_proj = w.linear(f"{prefix}.o_proj", d, a.num_heads * a.head_dim, a.o_bias)
        if a.qk_norm:
            whole = a.qk_norm == "all"  # over the whole projection, else over each head
            self.q_norm = w.norm(f"{prefix}.q_norm", a.num_heads * a.head_dim if whole else a.head_dim)
            self.k_norm = w.norm(f"{prefix}.k_norm", a.num_kv_heads * a.head_dim if whole else a.head_dim)
        self.sinks = w.tensor(f"{prefix}.sinks", (a.num_heads,), torch.float32) if a.sinks else None  # [H]

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H, Dh], k and v [T, Hkv, Dh]; q and k normed over the whole projection
        where the family does (a per-head norm goes with the rotation)."""
        a, t = self.a, x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        if a.qk_norm == "all":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim)
        return q, k, v.view(t, a.num_kv_heads, a.head_dim)

    def __call__(self, x: torch.Tensor, cos_sin, segments: list[Segment]) -> torch.Tensor:
        q, k, v = self._qkv(x)  # views of a fresh projection (or norm) output: normed and turned in place
        head_norm = self.a.qk_norm == "head"
        q = self.rotary.apply(q, *cos_sin, out=q, norm=self.q_norm if head_norm else None, eps=self.eps)
        k = self.rotary.apply(k, *cos_sin, out=k, norm=self.k_norm if head_norm else None, eps=self.eps)
        out = []
        for seg in segments:
            k_all, v_all = seg.kv.update(k[seg.rows], v[seg.rows])
            if self.sinks is None:
                out.append(_attend(q[seg.rows], k_all, v_all, seg.mask, self.a.softmax_scale, self.pool))
            else:
                out.append(_attend_with_sinks(q[seg.rows], k_all, v_all, seg.mask, self.a.softmax_scale, self.sinks,
                                              self.pool))
        return self.o_proj(out[0] if len(out) == 1 else torch.cat(out))


class MLAttention:
    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str, rotary: Rotary):
        a, d = cfg.attention, cfg.hidden_size
        self.a, self.eps, self.rotary, self.pool = a, cfg.rms_norm_eps, rotary, w.pool
        q_out = a.num_heads * a.head_dim
        # x's projections as one linear: the query's (q_proj, or q_a_proj of a low-rank query) and kv_a's
        kv_a = a.kv_lora_rank + a.qk_rope_head_dim
        q_first = q_out if a.q_lora_rank is None else a.q_lora_rank
        self.sizes = [q_first, kv_a]
        q_name = "q_proj" if a.q_lora_rank is None else "q_a_proj"
        self.x_proj = w.linears([f"{prefix}.{q_name}", f"{prefix}.kv_a_proj_with_mqa"], self.sizes, d, a.qkv_bias)
        if a.q_lora_rank is not None:
            self.q_a_layernorm = w.norm(f"{prefix}.q_a_layernorm", a.q_lora_rank)
            self.q_b_proj = w.linear(f"{prefix}.q_b_proj", q_out, a.q_lora_rank)
        self.kv_a_layernorm = w.norm(f"{prefix}.kv_a_layernorm", a.kv_lora_rank)
        # kept as a tensor: absorbed attention folds its two parts into the query and the output
        self.kv_b_proj = w.float_linear(f"{prefix}.kv_b_proj", a.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
                                        a.kv_lora_rank)
        self._kv_b = None  # kv_b_proj's weight as key and value parts, for absorbed attention
        self.o_proj = w.linear(f"{prefix}.o_proj", d, a.num_heads * a.v_head_dim, a.o_bias)

    def __call__(self, x: torch.Tensor, cos_sin, segments: list[Segment]) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        q, kv_a = self.x_proj(x).split(self.sizes, dim=-1)
        if a.q_lora_rank is not None:
            q = self.q_b_proj(rms_norm(q, self.q_a_layernorm, self.eps))
        q = q.reshape(t, a.num_heads, a.head_dim)
        q_nope, q_rot = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rot = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)  # [T, C], [T, R]
        latent = rms_norm(latent, self.kv_a_layernorm, self.eps)
        q = torch.cat((q_nope, self.rotary.apply(q_rot, *cos_sin)), dim=-1)
        k_rot = self.rotary.apply(k_rot[:, None, :], *cos_sin)[:, 0]
        out = []
        for seg in segments:
            latent_all, k_rot_all = seg.kv.update(latent[seg.rows], k_rot[seg.rows])  # [S, C], [S, R]
            out.append(self._attend_cached(q[seg.rows], latent_all, k_rot_all, seg.mask))
        return self.o_proj(out[0] if len(out) == 1 else torch.cat(out))

    def _attend_cached(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, mask: torch.Tensor):
        """q [T, H, N + R] against one sequence's cache: latent [S, C], k_rot [S, R] -> [T, H * V].
        A few new tokens against a long cache attend over the latent itself (absorbed); a prompt
        chunk expands the cache's keys and values once for all its rows."""
        if q.shape[0] <= ABSORB_MAX_TOKENS:
            return self._attend_absorbed(q, latent, k_rot, mask)
        a, s = self.a, latent.shape[0]
        k_nope, v = self.kv_b_proj(latent).view(s, a.num_heads, -1).split([a.qk_nope_head_dim, a.v_head_dim], -1)
        k = torch.cat((k_nope, k_rot[:, None, :].expand(s, a.num_heads, a.qk_rope_head_dim)), dim=-1)
        return _attend(q, k, v, mask, a.softmax_scale)

    def _attend_absorbed(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, mask: torch.Tensor):
        """The same attention without expanding the cache: kv_b_proj's key part folds into the query,
        q_nope . (W_k latent) = (W_k^T q_nope) . latent, and its value part applies after the
        weighted sum of latents; each step reads the [S, C + R] cache instead of making [S, H, N + V].
        With the native pool, float32, all of it is one native call: the latent as one key and value
        head shared by every query head, the rotary keys as the keys' second part, and both folds."""
        a, t = self.a, q.shape[0]
        w_k, w_v = self._kv_b_parts()  # [H, N, C], [H, V, C]
        q_nope, q_rot = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        shared = latent[:, None, :]  # [S, 1, C]
        out = _native_attend(q_nope, shared, shared, mask, a.softmax_scale, None, self.pool, q_rot, k_rot[:, None, :],
                             w_k, w_v)
        if out is not None:
            return out
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_k)  # [T, H, C]
        logits = torch.einsum("thc,sc->hts", q_latent, latent) + torch.einsum("thr,sr->hts", q_rot, k_rot)
        probs = (logits * a.softmax_scale).masked_fill(~mask[None], float("-inf")).softmax(dim=-1)  # [H, T, S]
        o_latent = torch.einsum("hts,sc->thc", probs.to(latent.dtype), latent)  # [T, H, C]
        return torch.einsum("thc,hvc->thv", o_latent, w_v).reshape(t, -1)

    def _kv_b_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.a
        if self._kv_b is None:
            w = self.kv_b_proj.weight.view(a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
            self._kv_b = tuple(part.contiguous() for part in w.split([a.qk_nope_head_dim, a.v_head_dim], dim=1))
        return self._kv_b


def make_attention(cfg: ModelConfig, w: WeightLoader, prefix: str, rotary: Rotary):
    cls = MLAttention if cfg.attention.kind == "mla" else GQAttention
    return cls(cfg, w, prefix, rotary)
