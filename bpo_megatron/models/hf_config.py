"""The Hugging Face ``config.json`` of a supported checkpoint, parsed and checked.

Only what the Megatron model needs is kept, in one vocabulary for every family
(:mod:`bpo_megatron.models.families` maps each ``model_type`` onto it). Fields that fix the shape of
the network (and ``norm_topk_prob``, whose transformers default differs from the released MoE
checkpoints) are required; the others default the way transformers fills them in. Anything the
Megatron model cannot reproduce exactly (RoPE scaling other than a family's YaRN, sliding-window attention, biases Megatron
has no place for, other activations) is refused here, so a checkpoint never loads into a model that
computes something else.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpo_megatron.models.families import FAMILIES, ModelFamily, config_error, family_of

# model_type -> the architecture name transformers writes for it
ARCHITECTURES: dict[str, str] = {name: family.architecture for name, family in FAMILIES.items()}

_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
)
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)
_POSITIVE_MOE_INTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_error = config_error


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling in Megatron's terms (``rope_type="yarn"``): the inverse frequencies
    interpolated by ``factor`` outside the correction range of ``beta_fast``/``beta_slow`` over
    ``original_max_position_embeddings``, cos and sin scaled by mscale(factor, ``mscale``) /
    mscale(factor, ``mscale_all_dim``) and the softmax scale by mscale(factor, ``mscale_all_dim``)²."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("rope_scaling.factor", self.factor, integer=False)
        _check_positive("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings,
                        integer=True)
        for name in ("beta_fast", "beta_slow", "mscale"):
            _check_positive(f"rope_scaling.{name}", getattr(self, name), integer=False)
        if isinstance(self.mscale_all_dim, bool) or not isinstance(self.mscale_all_dim, (int, float)) \
                or self.mscale_all_dim < 0:
            raise _error(f"rope_scaling.mscale_all_dim={self.mscale_all_dim!r} must be a non-negative number")

    def to_hf_dict(self, rope_theta: float) -> dict[str, Any]:
        return {"rope_type": "yarn", "rope_theta": rope_theta, "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "mscale": self.mscale,
                "mscale_all_dim": self.mscale_all_dim}


@dataclass(frozen=True)
class HFModelConfig:
    """Architecture of a checkpoint of one of the :data:`~bpo_megatron.models.families.FAMILIES`.

    For a dense model the MoE fields keep their zero defaults; the defaults of the others are
    Qwen3's (QK-norm, full RoPE, softmax routing, no shared expert). Construct it with :meth:`load`
    (from a ``config.json`` path, its directory, or the parsed dict); direct construction is
    validated the same way.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    qk_norm: bool = True  # RMSNorm on every query and key head
    rotary_percent: float = 1.0  # the share of each head's dims RoPE rotates (the leading ones)
    router_score: str = "softmax"  # "softmax" or "sigmoid" (scored independently per expert)
    router_expert_bias: bool = False  # a fixed per-expert bias added to the scores for the choice only
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' (renormalised) weights
    n_group: int = 1  # group-limited routing: experts in n_group groups, the best topk_group kept
    topk_group: int = 1
    shared_expert_intermediate_size: int = 0  # an always-on SwiGLU beside the routed experts (0: none)
    first_k_dense_replace: int = 0  # GLM/DeepSeek: the first k layers are dense
    # Multi-head latent attention (DeepSeek-V3): keys and values come from one compressed latent of
    # kv_lora_rank dims per token (0: ordinary attention), queries from one of q_lora_rank dims (None: a
    # plain projection); each head's query and key are qk_nope_head_dim dims without RoPE then head_dim
    # (transformers' qk_rope_head_dim) rotated ones, its value v_head_dim dims.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    yarn: YarnScaling | None = None  # YaRN RoPE scaling (None: plain RoPE)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # The parsed config.json as read (None when constructed directly). It travels with
    # checkpoints so they can be exported back to Hugging Face with every field the original had
    # (token ids, dtype, ...); it takes no part in equality, hashing or validation.
    source: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        family = family_of(self.model_type)
        if isinstance(self.mlp_only_layers, list):  # keep the config hashable and immutable
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        moe = family.moe or self.num_experts != 0
        for name in _POSITIVE_INTS + (_POSITIVE_MOE_INTS if moe else ()):
            _check_positive(name, getattr(self, name), integer=True)
        _check_positive("rms_norm_eps", self.rms_norm_eps, integer=False)
        _check_positive("rope_theta", self.rope_theta, integer=False)
        for name in ("tie_word_embeddings", "attention_bias", "norm_topk_prob", "qk_norm", "router_expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise _error(f"{name}={getattr(self, name)!r} must be true or false")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise _error(f"num_key_value_heads={self.num_key_value_heads} must divide "
                         f"num_attention_heads={self.num_attention_heads}")
        self._check_rotary()
        self._check_latent_attention()
        if self.yarn is not None and "yarn" not in family.rope_scalings:
            raise _error(f"YaRN RoPE scaling is not supported for {self.model_type}")
        if self.router_score not in ("softmax", "sigmoid"):
            raise _error(f"router scoring {self.router_score!r} must be 'softmax' or 'sigmoid'")
        if self.router_expert_bias and self.router_score != "sigmoid":
            raise _error("an expert score bias needs sigmoid routing (Megatron applies it to sigmoid scores only)")
        _check_positive("routed_scaling_factor", self.routed_scaling_factor, integer=False)
        if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
            raise _error(f"shared expert size {self.shared_expert_intermediate_size!r} must be a "
                         "non-negative integer")
        if moe and self.num_experts_per_tok > self.num_experts:
            raise _error(f"num_experts_per_tok={self.num_experts_per_tok} must not exceed "
                         f"num_experts={self.num_experts}")
        family.check(self)

    def _check_rotary(self) -> None:
        _check_positive("partial_rotary_factor", self.rotary_percent, integer=False)
        rotary_dim = int(self.head_dim * self.rotary_percent)
        if self.rotary_percent > 1 or rotary_dim % 2 or rotary_dim == 0:
            raise _error(f"partial_rotary_factor={self.rotary_percent!r} must be at most 1 and rotate an even, "
                         f"non-zero number of the head_dim={self.head_dim} dimensions (it rotates {rotary_dim})")

    def _check_latent_attention(self) -> None:
        if not isinstance(self.kv_lora_rank, int) or isinstance(self.kv_lora_rank, bool) or self.kv_lora_rank < 0:
            raise _error(f"kv_lora_rank={self.kv_lora_rank!r} must be a non-negative integer")
        if not self.kv_lora_rank:
            for name in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) not in (None, 0):
                    raise _error(f"{name}={getattr(self, name)!r} needs latent attention (kv_lora_rank > 0)")
            return
        for name in ("qk_nope_head_dim", "v_head_dim"):
            _check_positive(name, getattr(self, name), integer=True)
        if self.q_lora_rank is not None:
            _check_positive("q_lora_rank", self.q_lora_rank, integer=True)

    @property
    def multi_latent_attention(self) -> bool:
        """Whether attention is DeepSeek's multi-head latent attention (MLA)."""
        return self.kv_lora_rank > 0

    @property
    def query_key_head_dim(self) -> int:
        """The dims of one head's query and key: ``head_dim`` (for MLA the RoPE part, after the
        ``qk_nope_head_dim`` without it)."""
        return self.qk_nope_head_dim + self.head_dim

    @property
    def value_head_dim(self) -> int:
        """The dims of one head's value (and of its attention output)."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def family(self) -> ModelFamily:
        """The :class:`~bpo_megatron.models.families.ModelFamily` of this ``model_type``."""
        return family_of(self.model_type)

    @property
    def architecture(self) -> str:
        return self.family.architecture

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the Mixture-of-Experts layers, by transformers' rule for the family."""
        return self.family.moe_layers(self)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def weights_dtype(self) -> str:
        """The dtype the Hugging Face weights are stored in (``dtype``, or transformers 4's
        ``torch_dtype``), ``"float32"`` when the config does not say."""
        raw = self.source or {}
        return str(raw.get("dtype") or raw.get("torch_dtype") or "float32")

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict for this architecture: the parsed original when there is one
        (a deep copy), otherwise the fields here in transformers' naming."""
        if self.source is not None:
            return copy.deepcopy(dict(self.source))
        raw: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "dtype": "float32",
        }
        if self.rotary_percent != 1.0 or self.family.rotary_default != 1.0:
            raw["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                      "partial_rotary_factor": self.rotary_percent}
        if self.yarn is not None:
            raw["rope_parameters"] = self.yarn.to_hf_dict(self.rope_theta)
        raw.update(self.family.hf_fields(self))
        return raw

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> HFModelConfig:
        """Parse a ``config.json`` file, a checkpoint directory holding one, or its dict."""
        if isinstance(source, Mapping):
            return _from_dict(source)
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        with path.open() as handle:
            return _from_dict(json.load(handle))


def _check_positive(name: str, value: Any, *, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise _error(f"{name}={value!r} must be {kind}")


def _model_type(raw: Mapping[str, Any]) -> str:
    model_type = family_of(raw.get("model_type")).model_type
    architectures = raw.get("architectures")
    if architectures is not None and list(architectures) != [ARCHITECTURES[model_type]]:
        raise _error(f"architectures={architectures!r} is not supported for "
                     f"model_type={model_type!r}; expected [{ARCHITECTURES[model_type]!r}]")
    return model_type


def _rope(raw: Mapping[str, Any], family: ModelFamily) -> tuple[Any, YarnScaling | None]:
    """The RoPE base, from ``rope_theta`` (transformers 4) or ``rope_parameters`` (5), and its YaRN
    scaling where the family's Megatron counterpart reproduces it (``ModelFamily.rope_scalings``)."""
    scaling = raw.get("rope_scaling")
    parameters = raw.get("rope_parameters") or {}
    if scaling is not None and not isinstance(scaling, Mapping):
        raise _error(f"rope_scaling={scaling!r} must be a mapping or null")
    if not isinstance(parameters, Mapping):
        raise _error(f"rope_parameters={parameters!r} must be a mapping")
    yarn = None
    for name, given in (("rope_scaling", scaling or {}), ("rope_parameters", parameters)):
        kind = given.get("rope_type", given.get("type", "default"))
        if kind == "default":
            continue
        if kind not in family.rope_scalings:
            allowed = " or ".join(("plain RoPE",) + family.rope_scalings)
            raise _error(f"{name}={dict(given)!r} is not supported for {family.model_type} (only {allowed})")
        found = _yarn(name, given)
        if yarn is not None and found != yarn:
            raise _error(f"rope_scaling={dict(scaling)!r} disagrees with rope_parameters={dict(parameters)!r}")
        yarn = found
    theta = raw.get("rope_theta", parameters.get("rope_theta"))
    if theta is None:
        raise _error("required field 'rope_theta' is missing")
    if "rope_theta" in parameters and parameters["rope_theta"] != theta:
        raise _error(f"rope_theta={theta!r} disagrees with "
                     f"rope_parameters.rope_theta={parameters['rope_theta']!r}")
    return theta, yarn


def _yarn(name: str, given: Mapping[str, Any]) -> YarnScaling:
    """transformers' YaRN parameters as Megatron's, where Megatron computes the same: the inverse
    frequencies and the attention factor on cos and sin, and the softmax scale's mscale²."""
    for key in ("factor", "original_max_position_embeddings"):
        if given.get(key) is None:
            raise _error(f"{name}.{key} is required for YaRN RoPE")
    if given.get("attention_factor") is not None:
        raise _error(f"{name}.attention_factor={given['attention_factor']!r} is not supported: Megatron derives "
                     "the attention factor from factor, mscale and mscale_all_dim")
    if given.get("truncate", True) is not True:
        raise _error(f"{name}.truncate={given['truncate']!r} is not supported: Megatron rounds the YaRN "
                     "correction range to whole dimensions (truncate=true)")
    mscale, mscale_all_dim = given.get("mscale"), given.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        scales = (float(mscale), float(mscale_all_dim))
    elif mscale_all_dim:
        raise _error(f"{name}.mscale_all_dim={mscale_all_dim!r} without mscale is not supported: transformers "
                     "then scales cos and sin by the factor alone, which Megatron cannot combine with it")
    else:
        scales = (1.0, 0.0)  # transformers' attention factor from the factor alone, no softmax mscale
    return YarnScaling(factor=given["factor"], original_max_position_embeddings=given["original_max_position_embeddings"],
                       beta_fast=given.get("beta_fast") or 32, beta_slow=given.get("beta_slow") or 1,
                       mscale=scales[0], mscale_all_dim=scales[1])


def _rotary_percent(raw: Mapping[str, Any], default: float) -> Any:
    """``partial_rotary_factor``, from ``rope_parameters`` (transformers 5) or the top level (4);
    absent, the family's default, as transformers' modeling code assumes it."""
    parameters = raw.get("rope_parameters") or {}
    inside, outside = parameters.get("partial_rotary_factor"), raw.get("partial_rotary_factor")
    if inside is not None and outside is not None and inside != outside:
        raise _error(f"partial_rotary_factor={outside!r} disagrees with "
                     f"rope_parameters.partial_rotary_factor={inside!r}")
    return inside if inside is not None else outside if outside is not None else default


def _check_attention_and_activation(raw: Mapping[str, Any]) -> None:
    if raw.get("use_sliding_window", False):
        raise _error("use_sliding_window=True is not supported (full causal attention only)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        raise _error("layer_types must all be 'full_attention'; sliding-window layers are "
                     "not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise _error(f"hidden_act={raw['hidden_act']!r} is not supported (Qwen3 uses 'silu')")


def _head_dim(raw: Mapping[str, Any]) -> Any:
    """``head_dim``, or hidden_size / num_attention_heads when absent (or null), as transformers'
    modeling code derives it."""
    if raw.get("head_dim") is not None:
        return raw["head_dim"]
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)):
        return None  # the size checks name the bad field
    if hidden % heads != 0:
        raise _error(f"head_dim is missing and hidden_size={hidden} is not divisible by "
                     f"num_attention_heads={heads}")
    return hidden // heads


def _from_dict(raw: Mapping[str, Any]) -> HFModelConfig:
    source = copy.deepcopy(dict(raw))
    family = family_of(_model_type(raw))
    for name in _REQUIRED + family.required:
        if name not in raw:
            raise _error(f"required field {name!r} is missing")
    _check_attention_and_activation(raw)
    fields: dict[str, Any] = {name: raw[name] for name in _REQUIRED}
    rope_theta, yarn = _rope(raw, family)
    fields.update(
        model_type=family.model_type,
        head_dim=_head_dim(raw),
        rope_theta=rope_theta,
        yarn=yarn,
        rotary_percent=_rotary_percent(raw, family.rotary_default),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
    )
    fields.update(family.parse(raw))
    return HFModelConfig(**fields, source=source)
