"""The Hugging Face ``config.json`` of a Qwen3 or Qwen3-MoE checkpoint, parsed and checked.

Only what the Megatron model needs is kept. Fields that fix the shape of the network (and
``norm_topk_prob``, whose transformers default differs from the released MoE checkpoints) are
required; the others default the way transformers fills them in. Anything the Megatron model cannot
reproduce exactly (RoPE scaling, sliding-window attention, attention biases, other activations) is
refused here, so a checkpoint never loads into a model that computes something else.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type -> the architecture name transformers writes for it
ARCHITECTURES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
)
_REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)
_POSITIVE_MOE_INTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "decoder_sparse_step")


def _error(message: str) -> ValueError:
    return ValueError(f"config.json: {message}")


@dataclass(frozen=True)
class HFModelConfig:
    """Architecture of a ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` checkpoint.

    For a dense model the MoE fields keep their zero defaults. Construct it with :meth:`load`
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
    # The parsed config.json as read (None when constructed directly). It travels with
    # checkpoints so they can be exported back to Hugging Face with every field the original had
    # (token ids, dtype, ...); it takes no part in equality, hashing or validation.
    source: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise _error(f"model_type={self.model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
        if isinstance(self.mlp_only_layers, list):  # keep the config hashable and immutable
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        moe = self.model_type == "qwen3_moe"
        for name in _POSITIVE_INTS + (_POSITIVE_MOE_INTS if moe else ()):
            _check_positive(name, getattr(self, name), integer=True)
        _check_positive("rms_norm_eps", self.rms_norm_eps, integer=False)
        _check_positive("rope_theta", self.rope_theta, integer=False)
        for name in ("tie_word_embeddings", "attention_bias", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise _error(f"{name}={getattr(self, name)!r} must be true or false")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise _error(f"num_key_value_heads={self.num_key_value_heads} must divide "
                         f"num_attention_heads={self.num_attention_heads}")
        if self.attention_bias:
            # Qwen3 puts the bias on o_proj as well; Megatron's add_qkv_bias covers only the
            # fused QKV projection, so such a checkpoint has no exact Megatron counterpart.
            raise _error("attention_bias=True is not supported (Megatron has no bias on the "
                         "attention output projection alone)")
        if moe:
            self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise _error(f"num_experts_per_tok={self.num_experts_per_tok} must not exceed "
                         f"num_experts={self.num_experts}")
        if not isinstance(self.router_aux_loss_coef, (int, float)) or isinstance(
                self.router_aux_loss_coef, bool) or self.router_aux_loss_coef < 0:
            raise _error(f"router_aux_loss_coef={self.router_aux_loss_coef!r} must be a "
                         "non-negative number")
        for layer in self.mlp_only_layers:
            if not isinstance(layer, int) or isinstance(layer, bool) or not (
                    0 <= layer < self.num_hidden_layers):
                raise _error(f"mlp_only_layers contains {layer!r}; entries must be layer "
                             f"indices in [0, {self.num_hidden_layers})")

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the Mixture-of-Experts layers, by transformers' Qwen3-MoE rule."""
        if self.model_type != "qwen3_moe":
            return ()
        return tuple(
            layer for layer in range(self.num_hidden_layers)
            if layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

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
        if self.model_type == "qwen3_moe":
            raw.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
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
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _error(f"model_type={model_type!r} is not supported; "
                     f"supported: {', '.join(sorted(ARCHITECTURES))}")
    architectures = raw.get("architectures")
    if architectures is not None and list(architectures) != [ARCHITECTURES[model_type]]:
        raise _error(f"architectures={architectures!r} is not supported for "
                     f"model_type={model_type!r}; expected [{ARCHITECTURES[model_type]!r}]")
    return model_type


def _rope_theta(raw: Mapping[str, Any]) -> float:
    """The RoPE base, from ``rope_theta`` (transformers 4) or ``rope_parameters`` (5)."""
    scaling = raw.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, Mapping)
                                or scaling.get("rope_type", scaling.get("type")) != "default"):
        raise _error(f"rope_scaling={scaling!r} is not supported (only plain RoPE)")
    parameters = raw.get("rope_parameters") or {}
    if not isinstance(parameters, Mapping) or parameters.get("rope_type", "default") != "default":
        raise _error(f"rope_parameters={parameters!r} is not supported (only plain RoPE)")
    theta = raw.get("rope_theta", parameters.get("rope_theta"))
    if theta is None:
        raise _error("required field 'rope_theta' is missing")
    if "rope_theta" in parameters and parameters["rope_theta"] != theta:
        raise _error(f"rope_theta={theta!r} disagrees with "
                     f"rope_parameters.rope_theta={parameters['rope_theta']!r}")
    return theta


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


def _num_experts_alias(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``; read either."""
    if "num_local_experts" not in raw:
        return raw
    if "num_experts" in raw and raw["num_experts"] != raw["num_local_experts"]:
        raise _error(f"num_experts={raw['num_experts']!r} disagrees with "
                     f"num_local_experts={raw['num_local_experts']!r}")
    return {**raw, "num_experts": raw["num_local_experts"]}


def _from_dict(raw: Mapping[str, Any]) -> HFModelConfig:
    source = copy.deepcopy(dict(raw))
    model_type = _model_type(raw)
    moe = model_type == "qwen3_moe"
    if moe:
        raw = _num_experts_alias(raw)
    for name in _REQUIRED + (_REQUIRED_MOE if moe else ()):
        if name not in raw:
            raise _error(f"required field {name!r} is missing")
    _check_attention_and_activation(raw)
    fields: dict[str, Any] = {name: raw[name] for name in _REQUIRED}
    fields.update(
        model_type=model_type,
        head_dim=_head_dim(raw),
        rope_theta=_rope_theta(raw),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
    )
    if moe:
        mlp_only = raw.get("mlp_only_layers") or []
        if not isinstance(mlp_only, (list, tuple)):
            raise _error(f"mlp_only_layers={mlp_only!r} must be a list of layer indices")
        fields.update({name: raw[name] for name in _REQUIRED_MOE})
        fields.update(
            decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(mlp_only),
            router_aux_loss_coef=raw.get("router_aux_loss_coef", 0.001),
        )
    return HFModelConfig(**fields, source=source)
