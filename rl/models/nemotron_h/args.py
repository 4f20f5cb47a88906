"""NemotronH config.json -> the network's sizes (torch-free), and total / active parameter counts.

`NemotronHArgs.from_hf(config_dict)` reads a checkpoint's config.json (text tower) as transformers 5.19's
`NemotronHConfig` does, including its backward-compatible aliases (`hybrid_override_pattern` "M*E-" strings,
`mamba_n_groups`, `mamba_d_conv`, ...). Anything the trainer's network would compute differently from
transformers is refused by `check()` with a one-line ValueError naming the config key.

`NemotronHArgs.layers()` / `mtp_layers()` are the blocks as rows of rl.models.layers' calculators (Mamba-2,
GQA without positional embedding, LatentMoE, non-gated MLP; the MTP layers frozen, with their fusion
projection and norms), the rows the plan arithmetic (rl.plan_math, launch.perf) sums; `from_model` reads
them for a composed `model` group from its checkpoint's config.json. `param_counts(config_dict)` sums the
same rows into total and active (per token) parameters, main network and MTP layers separately, so a config
card can be checked against a model card's "550B total / 55B active".

`model_fields()` is what composition writes into the `model` group (rl.models.fields): the GQA attention and
routed-expert sizes (`HF_FIELDS`). The layer pattern, Mamba-2, LatentMoE and MTP sizes have no `model` fields:
every reader takes them from config.json through `from_model`. No RoPE, so `rope_theta` stays as the yaml has
it. A network is never created here without a checkpoint (rl.tiny_models.tiny writes none: the tiny twin,
rl.tiny_models.twins, is written from transformers' own config class).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from rl.models import layers as L

NAME = "nemotron_h"
HF_CONFIG_CLASS = "NemotronHConfig"
HF_MODEL_CLASS = "NemotronHForCausalLM"

_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
            "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
            "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
            "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
ACTIVATIONS = ("relu2", "silu", "gelu", "relu")


def _types(v) -> tuple[str, ...]:
    if isinstance(v, str):
        return tuple(_PATTERN[c] for c in v)
    return tuple(_LEGACY_TYPES.get(t, t) for t in v)


@dataclass(frozen=True)
class NemotronHArgs:
    vocab_size: int = 131072
    hidden_size: int = 4096
    layer_types: tuple[str, ...] = ("linear_attention", "moe", "full_attention", "mlp")
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ("full_attention", "moe")
    # attention (no positional embedding in NemotronH attention: HF defines RoPE helpers but never applies them)
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    # dense MLP layers ("-")
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba-2
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False            # Mamba in_proj / out_proj bias (HF: config.use_bias)
    time_step_min: float = 0.001      # HF clamps dt to [time_step_min, inf) in its scan (see the mixer)
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    # LatentMoE
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # the rest
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    FAMILY = NAME
    # the `model` group fields config.json determines (model_fields()); rl.models.fields zeroes the other
    # sizes (MLA, DSA, dense layers) and leaves rope_theta alone
    HF_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "top_k", "moe_hidden_dim", "n_kv_heads", "head_dim",
                 "num_experts")
    # keys the `model` group needs written out: a config.json without them is refused by name rather than
    # planned with transformers' defaults
    _REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "num_experts_per_tok",
                 "moe_intermediate_size", "n_routed_experts")

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def latent(self) -> int:
        return self.moe_latent_size or self.hidden_size

    @property
    def mtp_types(self) -> tuple[str, ...]:
        """The physical MTP layers: num_nextn_predict_layers steps of the MTP pattern each."""
        return tuple(self.mtp_layer_types) * int(self.num_nextn_predict_layers)

    def model_fields(self) -> dict:
        """The `model` group values config.json determines (`HF_FIELDS`); a missing size is a one-line
        CheckpointError naming its key."""
        from rl.contract import hf as hfc
        for k in self._REQUIRED:
            hfc.need(self.extra, k, self.FAMILY)
        return dict(vocab_size=self.vocab_size, dim=self.hidden_size, n_layers=self.n_layers,
                    n_heads=self.num_attention_heads, top_k=self.num_experts_per_tok,
                    moe_hidden_dim=self.moe_intermediate_size, n_kv_heads=self.num_key_value_heads,
                    head_dim=self.head_dim, num_experts=self.n_routed_experts)

    def layers(self) -> "tuple[L.Layer, ...]":
        """One row per block of the main network (rl.models.layers), in `layer_types` order."""
        return _layers(self)

    def mtp_layers(self) -> "tuple[L.Layer, ...]":
        """The frozen MTP layers' rows."""
        return _mtp_layers(self)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "NemotronHArgs":
        h = dict(hf)
        if "text_config" in h and "hidden_size" not in h:
            h = dict(h["text_config"])
        for old, new in _ALIASES.items():
            if old in h:
                h[new] = h.pop(old)
        if h.get("layers_block_type") is not None:
            types = _types(h["layers_block_type"])
        elif h.get("layer_types") is not None:
            types = _types(h["layer_types"])
        elif h.get("hybrid_override_pattern"):
            types = _types(h["hybrid_override_pattern"])
        else:
            types = cls.layer_types
        if h.get("mtp_layers_block_type") is not None:
            mtp = _types(h["mtp_layers_block_type"])
        elif h.get("mtp_hybrid_override_pattern"):
            mtp = _types(h["mtp_hybrid_override_pattern"])
        else:
            mtp = cls.mtp_layer_types
        names = {f for f in cls.__dataclass_fields__} - {"layer_types", "mtp_layer_types", "extra"}
        kw = {k: h[k] for k in names if h.get(k) is not None}
        if h.get("num_key_value_heads") is None and "num_attention_heads" in h:
            kw["num_key_value_heads"] = h["num_attention_heads"]
        a = cls(layer_types=types, mtp_layer_types=mtp, extra=h, **kw)
        check(a)
        return a


def from_hf(hf: Mapping[str, Any]) -> NemotronHArgs:
    """`NemotronHArgs.from_hf`, by the name every family's args module offers (rl.plan_math.shape)."""
    return NemotronHArgs.from_hf(hf)


def check(a: NemotronHArgs) -> None:
    """One-line ValueError naming the first config.json key this implementation does not follow."""
    h = a.extra

    def bad(key, why):
        raise ValueError(f"config.json {key}={h.get(key, getattr(a, key, None))!r} is not supported for "
                         f"NemotronH ({why})")
    if h.get("model_type", NAME) != NAME:
        bad("model_type", f"expected {NAME!r}")
    valid = {"linear_attention", "full_attention", "moe", "mlp"}
    if not a.layer_types or set(a.layer_types) - valid:
        bad("layers_block_type", f"types {sorted(valid)}")
    if a.num_nextn_predict_layers and set(a.mtp_layer_types) - valid:
        bad("mtp_layers_block_type", f"types {sorted(valid)}")
    if h.get("mamba_hidden_act", "silu") != "silu":
        bad("mamba_hidden_act", "silu only (the conv activation and the gate)")
    if a.mlp_hidden_act not in ACTIVATIONS:
        bad("mlp_hidden_act", f"one of {ACTIVATIONS}")
    if a.tie_word_embeddings:
        bad("tie_word_embeddings", "false only")
    if h.get("sliding_window"):
        bad("sliding_window", "transformers' NemotronH attention is full causal")
    if a.mamba_num_heads % a.n_groups:
        bad("n_groups", "must divide mamba_num_heads")
    if a.n_routed_experts % a.n_group:
        bad("n_group", "must divide n_routed_experts")
    if a.num_attention_heads % a.num_key_value_heads:
        bad("num_key_value_heads", "must divide num_attention_heads")
    scoring = h.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        bad("scoring_func", "transformers' NemotronH router is sigmoid only")


# -- the layers the plan arithmetic sums over (rl.models.layers) ---------------------------------------
def _part(a: NemotronHArgs, kind: str):
    """The calculator of one block of config.json layer type `kind`."""
    d = a.hidden_size
    if kind == "linear_attention":
        ssm = str(a.extra.get("mamba_ssm_cache_dtype") or "float32")   # vLLM's SSM state dtype
        return L.Mamba2(dim=d, heads=a.mamba_num_heads, head_dim=a.mamba_head_dim, n_groups=a.n_groups,
                        ssm_state=a.ssm_state_size, conv_kernel=a.conv_kernel, chunk_size=a.chunk_size,
                        conv_bias=a.use_conv_bias, bias=a.use_bias, ssm_cache_bytes=4 if "32" in ssm else 2)
    if kind == "full_attention":          # no positional embedding (HF never applies its RoPE helpers)
        return L.GQA(dim=d, n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads,
                     head_dim=a.head_dim, rope=False)
    if kind == "mlp":
        return L.MLP(dim=d, hidden=a.intermediate_size, gated=False, bias=a.mlp_bias)
    return L.LatentMoE(dim=d, hidden=a.moe_intermediate_size, n_experts=a.n_routed_experts,
                       top_k=a.num_experts_per_tok, latent=int(a.moe_latent_size or 0),
                       shared_hidden=a.moe_shared_expert_intermediate_size, bias=a.mlp_bias)


def _layers(a: NemotronHArgs) -> tuple[L.Layer, ...]:
    """One row per block of the main network, in order (`layer_types`)."""
    return tuple(L.Layer(a.hidden_size, (_part(a, t),)) for t in a.layer_types)


def _mtp_layers(a: NemotronHArgs) -> tuple[L.Layer, ...]:
    """The MTP layers (frozen): the same blocks, plus per step the fusion projection eh_proj and its two
    norms on the first layer of the step and a final norm on its last."""
    d, n = a.hidden_size, len(a.mtp_layer_types)
    return tuple(L.Layer(d, (_part(a, t),), frozen=True,
                         extra=(2 * d + 2 * d * d if i % n == 0 else 0) + (d if i % n == n - 1 else 0))
                 for i, t in enumerate(a.mtp_types))


def from_model(m, hf: Mapping[str, Any] | None = None) -> NemotronHArgs:
    """The args of the typed `model` group `m`: the layer pattern, Mamba-2, LatentMoE and MTP sizes have
    no ModelConfig fields, so they come from `hf` (a config.json) or the checkpoint's (`m.hf_path`)."""
    from rl.contract import hf as hfc
    if hf is None:
        if not m.hf_path:
            raise ValueError(f"model.family={m.family}: its layer pattern and Mamba-2 sizes are in a "
                             f"config.json; set model.hf_path")
        hf = hfc.read_config(m.hf_path)
    return NemotronHArgs.from_hf(hfc.text_config(hf))


def param_counts(hf: Mapping[str, Any] | NemotronHArgs) -> dict[str, int]:
    """Total and active parameters of a NemotronH config: `total`, `active` (main network: embeddings,
    blocks, final norm, LM head), and `mtp_total` / `mtp_active` (the MTP layers, their fusion
    projections and norms; the embeddings and LM head they share are not counted again). Sums over
    `layers()` / `mtp_layers()`, the rows the plan arithmetic reads."""
    a = hf if isinstance(hf, NemotronHArgs) else NemotronHArgs.from_hf(hf)
    head = 2 * a.vocab_size * a.hidden_size + a.hidden_size
    main, mtp = a.layers(), a.mtp_layers()
    return dict(total=head + sum(x.params() for x in main), active=head + sum(x.active() for x in main),
                mtp_total=sum(x.params() for x in mtp), mtp_active=sum(x.active() for x in mtp))
