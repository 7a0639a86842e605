"""Hugging Face config.json -> one frozen, validated ModelConfig.

One parser per family reads that family's keys (old checkpoint dialects and transformers 5.x alike)
into the same generic shape, so the dense path and the expert server never look at raw JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from services.common.errors import ConfigError

ROUTER_METHODS = ("softmax_topk", "greedy", "group_limited_greedy", "noaux_tc", "topk_softmax")
ACTIVATIONS = ("silu", "swiglu_oai")  # silu(gate) * up; gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate)
ROPE_KINDS = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    kind: str  # one of ROPE_KINDS
    theta: float
    dim: int  # rotated dimensions per head
    interleaved: bool  # rotate (x0, x1), (x2, x3)... pairs instead of the two halves
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class AttentionConfig:
    kind: str  # "gqa" or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # gqa: q/k/v head size; mla: q/k head size (nope + rope)
    softmax_scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = ""  # "head": RMSNorm over each head (Qwen3, GLM); "all": over the whole projection (MiniMax-M2)
    sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax, then is dropped
    sliding_window: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class RouterConfig:
    method: str  # one of ROUTER_METHODS
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1


@dataclass(frozen=True)
class MoeConfig:
    router: RouterConfig
    intermediate_size: int  # per routed expert
    prefix: str  # module name inside a layer: "mlp" or "block_sparse_moe"
    expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_name: str = ""
    shared_gated: bool = False  # qwen2_moe: shared output scaled by sigmoid(shared_expert_gate(x))
    correction_bias: str = ""  # the router's score correction bias, inside the block; "": none
    gate_name: str = "gate"  # the router's module inside the block
    router_bias: bool = False  # gpt-oss: the router's linear has a bias
    activation: str = "silu"  # one of ACTIVATIONS
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # gpt-oss: each expert's projections have biases
    stacked: bool = False  # gpt-oss: [E, D, 2I] gate_up_proj (gate and up interleaved) and [E, I, D] down_proj

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_bias: bool
    attention: AttentionConfig
    rope: RopeConfig
    moe: MoeConfig
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...] = ()  # per layer, when layers differ (gpt-oss); else attention's

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else self.attention.sliding_window

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Checkpoint names of (gate, up, down) weights of one routed expert; for stacked experts
        (gpt-oss) the layer's (gate_up_proj, gate_up_proj, down_proj), which hold every expert."""
        if self.moe.stacked:
            base = f"model.layers.{layer}.{self.moe.prefix}.experts"
            return f"{base}.gate_up_proj", f"{base}.gate_up_proj", f"{base}.down_proj"
        base = f"model.layers.{layer}.{self.moe.prefix}.experts.{expert}"
        return tuple(f"{base}.{name}.weight" for name in self.moe.expert_names)  # type: ignore[return-value]

    def is_routed_expert_tensor(self, name: str) -> bool:
        return f".{self.moe.prefix}.experts." in name


class _Reader:
    """Typed access to a config.json dict; every failure names the key."""

    def __init__(self, raw: dict):
        self.raw = raw

    def get(self, key: str, kind: type, default=None, *, required: bool = False):
        value = self.raw.get(key, default)
        if value is None:
            if required:
                raise ConfigError(f"config.json: missing required key {key!r}")
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"config.json: {key!r} must be {kind.__name__}, got {value!r}")
        return value

    def positive(self, key: str, default=None) -> int:
        value = self.get(key, int, default, required=True)
        if value <= 0:
            raise ConfigError(f"config.json: {key!r} must be positive, got {value}")
        return value

    def first(self, keys: tuple[str, ...]) -> int:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.positive(key)
        raise ConfigError(f"config.json: missing the expert count (one of {', '.join(keys)})")


def _rope(r: _Reader, dim: int, interleaved: bool) -> RopeConfig:
    params = r.raw.get("rope_parameters") or r.raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError("config.json: 'rope_parameters' must be an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ConfigError(f"config.json: unsupported rope type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
    theta = params.get("rope_theta", r.raw.get("rope_theta", 10000.0))
    max_pos = r.positive("max_position_embeddings")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings", r.raw.get("original_max_position_embeddings"))
    if kind == "yarn" and factor is None:
        factor = max_pos / original if original else None
    if kind != "default" and factor is None:
        raise ConfigError(f"config.json: rope type {kind!r} needs 'factor'")
    return RopeConfig(
        kind=kind, theta=float(theta), dim=dim, interleaved=interleaved, factor=float(factor or 1.0),
        original_max_position_embeddings=int(original or max_pos),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _eos(r: _Reader) -> tuple[int, ...]:
    eos = r.raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _check_act(r: _Reader) -> None:
    act = r.raw.get("hidden_act", "silu")
    if r.raw.get("model_type") == "gpt_oss":
        return  # its experts' activation is its own (swiglu_alpha, swiglu_limit); hidden_act is not read
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")


def _router(r: _Reader, method: str, num_experts: int, norm: bool) -> RouterConfig:
    top_k = r.positive("num_experts_per_tok")
    n_group = r.get("n_group", int) or 1
    topk_group = r.get("topk_group", int) or 1
    if method in ("group_limited_greedy", "noaux_tc"):
        if num_experts % n_group:
            raise ConfigError(f"config.json: n_routed_experts ({num_experts}) not divisible by n_group ({n_group})")
        if not 1 <= topk_group <= n_group:
            raise ConfigError(f"config.json: topk_group ({topk_group}) must be in [1, n_group={n_group}]")
        if top_k > topk_group * (num_experts // n_group):
            raise ConfigError("config.json: num_experts_per_tok exceeds the experts of the selected groups")
    if top_k > num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok ({top_k}) exceeds the expert count ({num_experts})")
    scale = r.get("routed_scaling_factor", float, 1.0)
    return RouterConfig(method, num_experts, top_k, norm, scale, n_group, topk_group)


def _common(r: _Reader, family: str) -> dict:
    _check_act(r)
    return dict(
        family=family,
        vocab_size=r.positive("vocab_size"),
        hidden_size=r.positive("hidden_size"),
        num_layers=r.positive("num_hidden_layers"),
        intermediate_size=r.positive("intermediate_size"),
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6),
        max_position_embeddings=r.positive("max_position_embeddings"),
        tie_word_embeddings=bool(r.raw.get("tie_word_embeddings", False)),
        mlp_bias=bool(r.raw.get("mlp_bias", False)),
        bos_token_id=r.get("bos_token_id", int),
        eos_token_ids=_eos(r),
    )


def _deepseek(r: _Reader, family: str) -> ModelConfig:
    heads = r.positive("num_attention_heads")
    nope, rope_dim, v_dim = (r.positive(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    rope = _rope(r, rope_dim, interleaved=family == "deepseek_v2" or bool(r.raw.get("rope_interleave", True)))
    scale = (nope + rope_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    attention = AttentionConfig(
        kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope_dim, softmax_scale=scale,
        qkv_bias=bool(r.raw.get("attention_bias", False)), o_bias=bool(r.raw.get("attention_bias", False)),
        q_lora_rank=r.get("q_lora_rank", int), kv_lora_rank=r.positive("kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim,
    )
    num_experts = r.first(("n_routed_experts", "num_experts", "num_local_experts"))
    if family == "deepseek_v3":
        scoring = r.raw.get("scoring_func", "sigmoid")
        method = r.raw.get("topk_method", "noaux_tc")
        if scoring != "sigmoid" or method != "noaux_tc":
            raise ConfigError(
                f"config.json: deepseek_v3 routing scoring_func={scoring!r} topk_method={method!r} is not "
                "supported (only sigmoid + noaux_tc)"
            )
        norm = bool(r.raw.get("norm_topk_prob", True))
    else:
        method = r.raw.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"config.json: deepseek_v2 topk_method {method!r} is not supported")
        norm = False  # transformers' DeepseekV2 never renormalises; it is the numerical reference
    n_shared = r.get("n_shared_experts", int, 0)
    moe_inter = r.positive("moe_intermediate_size")
    moe = MoeConfig(
        router=_router(r, method, num_experts, norm), intermediate_size=moe_inter, prefix="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"), shared_intermediate_size=moe_inter * n_shared,
        shared_name="shared_experts", correction_bias="gate.e_score_correction_bias" if family == "deepseek_v3" else "",
    )
    first_dense = r.get("first_k_dense_replace", int, 0)
    freq = r.get("moe_layer_freq", int, 1) or 1
    layers = r.positive("num_hidden_layers")
    moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(layers))
    return ModelConfig(**_common(r, family), attention=attention, rope=rope, moe=moe, moe_layers=moe_layers)


def _gqa(r: _Reader, qkv_bias: bool, o_bias: bool, qk_norm: str, sliding_window: int | None) -> AttentionConfig:
    heads = r.positive("num_attention_heads")
    kv_heads = r.get("num_key_value_heads", int) or heads
    if heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads ({heads}) not divisible by num_key_value_heads ({kv_heads})")
    head_dim = r.get("head_dim", int) or r.positive("hidden_size") // heads
    return AttentionConfig(
        kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, softmax_scale=head_dim**-0.5,
        qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, sliding_window=sliding_window,
    )


def _qwen_moe(r: _Reader, family: str) -> ModelConfig:
    qwen3 = family == "qwen3_moe"
    window = r.get("sliding_window", int) if r.raw.get("use_sliding_window") else None
    bias = bool(r.raw.get("attention_bias", False)) if qwen3 else bool(r.raw.get("qkv_bias", True))
    attention = _gqa(r, qkv_bias=bias, o_bias=qwen3 and bias, qk_norm="head" if qwen3 else "", sliding_window=window)
    num_experts = r.first(("num_experts", "num_local_experts", "n_routed_experts"))
    shared = 0 if qwen3 else r.get("shared_expert_intermediate_size", int, 0)
    moe = MoeConfig(
        router=_router(r, "softmax_topk", num_experts, bool(r.raw.get("norm_topk_prob", qwen3))),
        intermediate_size=r.positive("moe_intermediate_size"), prefix="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"), shared_intermediate_size=shared,
        shared_name="shared_expert", shared_gated=shared > 0,
    )
    step = r.get("decoder_sparse_step", int, 1) or 1
    dense_only = set(r.raw.get("mlp_only_layers") or [])
    layers = r.positive("num_hidden_layers")
    moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
    rope = _rope(r, attention.head_dim, interleaved=False)
    return ModelConfig(**_common(r, family), attention=attention, rope=rope, moe=moe, moe_layers=moe_layers)


def _mixtral(r: _Reader, family: str) -> ModelConfig:
    attention = _gqa(r, qkv_bias=False, o_bias=False, qk_norm="", sliding_window=r.get("sliding_window", int))
    num_experts = r.first(("num_local_experts", "num_experts", "n_routed_experts"))
    moe = MoeConfig(
        router=_router(r, "softmax_topk", num_experts, True), intermediate_size=r.positive("intermediate_size"),
        prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
    )
    layers = r.positive("num_hidden_layers")
    rope = _rope(r, attention.head_dim, interleaved=False)
    return ModelConfig(**_common(r, family), attention=attention, rope=rope, moe=moe, moe_layers=(True,) * layers)


def _rotary_dim(r: _Reader, head_dim: int, default_factor: float) -> int:
    """Rotated dims per head: partial_rotary_factor (in rope_parameters or at the top level), or the
    legacy rotary_dim of MiniMax-M2's releases."""
    params = r.raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", r.raw.get("partial_rotary_factor"))
    if factor is None and r.raw.get("rotary_dim"):
        return r.positive("rotary_dim")
    dim = int(head_dim * (default_factor if factor is None else factor))
    if not 0 < dim <= head_dim or dim % 2:
        raise ConfigError(f"config.json: partial rotary of {dim} dims does not fit heads of {head_dim}")
    return dim


def _glm4_moe(r: _Reader, family: str) -> ModelConfig:
    attention = _gqa(r, qkv_bias=bool(r.raw.get("attention_bias", False)), o_bias=False,
                     qk_norm="head" if r.raw.get("use_qk_norm") else "", sliding_window=None)
    rope = _rope(r, _rotary_dim(r, attention.head_dim, 0.5), interleaved=False)
    num_experts = r.first(("n_routed_experts", "num_experts", "num_local_experts"))
    moe_inter = r.positive("moe_intermediate_size")
    moe = MoeConfig(
        router=_router(r, "noaux_tc", num_experts, bool(r.raw.get("norm_topk_prob", True))),
        intermediate_size=moe_inter, prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        shared_intermediate_size=moe_inter * r.get("n_shared_experts", int, 0), shared_name="shared_experts",
        correction_bias="gate.e_score_correction_bias",
    )
    first_dense = r.get("first_k_dense_replace", int, 0)
    layers = r.positive("num_hidden_layers")
    moe_layers = tuple(i >= first_dense for i in range(layers))
    return ModelConfig(**_common(r, family), attention=attention, rope=rope, moe=moe, moe_layers=moe_layers)


def _minimax_m2(r: _Reader, family: str) -> ModelConfig:
    """Sigmoid routing whose correction bias only selects; the chosen unbiased scores are always
    renormalised and never scaled (transformers' MiniMaxM2TopKRouter)."""
    attention = _gqa(r, qkv_bias=False, o_bias=False, qk_norm="all", sliding_window=None)
    rope = _rope(r, _rotary_dim(r, attention.head_dim, 1.0), interleaved=False)
    num_experts = r.first(("num_local_experts", "num_experts", "n_routed_experts"))
    top_k = r.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok ({top_k}) exceeds the expert count ({num_experts})")
    moe = MoeConfig(
        router=RouterConfig("noaux_tc", num_experts, top_k, norm_topk_prob=True), intermediate_size=r.positive("intermediate_size"),
        prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"), correction_bias="e_score_correction_bias",
    )
    layers = r.positive("num_hidden_layers")
    return ModelConfig(**_common(r, family), attention=attention, rope=rope, moe=moe, moe_layers=(True,) * layers)


def _gpt_oss(r: _Reader, family: str) -> ModelConfig:
    """Attention sinks, sliding and full layers by layer_types, q/k/v/o biases, YaRN; a router with a
    bias (top-k on its logits, softmax over the k); experts with biases, gate and up interleaved, and
    the clamped activation."""
    attention = _gqa(r, qkv_bias=bool(r.raw.get("attention_bias", True)), o_bias=bool(r.raw.get("attention_bias", True)),
                     qk_norm="", sliding_window=None)
    attention = replace(attention, sinks=True)
    layers = r.positive("num_hidden_layers")
    types = r.raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConfigError(f"config.json: layer_types must name sliding_attention or full_attention for each of {layers} layers")
    window = r.positive("sliding_window") if "sliding_attention" in types else None
    num_experts = r.first(("num_local_experts", "num_experts"))
    top_k = r.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok ({top_k}) exceeds the expert count ({num_experts})")
    moe = MoeConfig(
        router=RouterConfig("topk_softmax", num_experts, top_k, norm_topk_prob=False), intermediate_size=r.positive("intermediate_size"),
        prefix="mlp", expert_names=("gate_up_proj", "gate_up_proj", "down_proj"), gate_name="router", router_bias=True,
        activation="swiglu_oai", swiglu_alpha=r.get("swiglu_alpha", float, 1.702), swiglu_limit=r.get("swiglu_limit", float, 7.0),
        expert_bias=True, stacked=True,
    )
    rope = _rope(r, attention.head_dim, interleaved=False)
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return ModelConfig(**_common(r, family), attention=attention, rope=rope, moe=moe, moe_layers=(True,) * layers,
                       layer_windows=windows)


PARSERS: dict[str, Callable[[_Reader, str], ModelConfig]] = {
    "deepseek_v3": _deepseek,
    "kimi_k2": _deepseek,
    "deepseek_v2": _deepseek,
    "qwen3_moe": _qwen_moe,
    "qwen2_moe": _qwen_moe,
    "mixtral": _mixtral,
    "glm4_moe": _glm4_moe,
    "minimax_m2": _minimax_m2,
    "gpt_oss": _gpt_oss,
}


def parse_model_config(raw: dict) -> ModelConfig:
    """Validate a config.json dict and return the generic ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in PARSERS:
        raise ConfigError(
            f"config.json: unsupported model_type {model_type!r} (supported: {', '.join(sorted(PARSERS))})"
        )
    family = "deepseek_v3" if model_type == "kimi_k2" else model_type
    try:
        return PARSERS[model_type](_Reader(raw), family)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: invalid {model_type} configuration: {exc}") from exc
