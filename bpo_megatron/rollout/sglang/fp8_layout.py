"""Which of a model's quantized layers SGLang 0.5.23 can build in block FP8 at an engine's layout.

SGLang builds a block-FP8 layer (``--quantization fp8`` on a checkpoint of 128 × 128 weight blocks,
:mod:`bpo_megatron.weights.fp8`) only where each partition it cuts per rank lines up with the
blocks (``layers/quantization/fp8.py``, the linear and MoE methods' ``create_weights``):

* a linear layer split over the TP ranks by its output, or one that merges projections (q/k/v,
  gate/up — even at TP 1): each projection's output partition a multiple of 128;
* a row-parallel linear layer (``o_proj``, ``down_proj``) at TP > 1: its input partition a multiple
  of 128;
* the routed experts: ``moe_intermediate_size / moe_tp_size`` a multiple of 128, with
  ``moe_tp_size = tp_size // ep_size``; the server also refuses to start otherwise
  (``check_quantized_moe_compatibility``), whatever the checkpoint leaves unquantized.

What the project does about a layer SGLang cannot build: a linear layer is served in bf16 — listed
in the FP8 copy's ``quantization_config.ignored_layers`` (the key ``Fp8Config.from_config`` reads),
kept bf16 in that copy and sent in bf16 at every sync; routed experts need another layout, so the
config is refused naming the ``rollout.sglang.ep_size`` values that work.

How the layers are cut follows SGLang's model code for the families served here
(``models/qwen3_moe.py``, ``models/glm4_moe.py``, no attention data parallelism): q/k/v one merged
column-parallel layer over TP (KV heads replicated when fewer than the ranks), ``o_proj``
row-parallel; a dense MLP's gate/up merged column-parallel, ``down_proj`` row-parallel; a shared
expert the same over TP, or one more routed expert where SGLang fuses it into the experts (GLM-4.5
on CUDA without expert parallelism, unless ``--disable-shared-experts-fusion``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from bpo_megatron.rollout.engine import QuantizedLayout
from bpo_megatron.weights import fp8

if TYPE_CHECKING:
    from bpo_megatron.models.hf_config import HFModelConfig
    from bpo_megatron.rollout.sglang.options import SGLangOptions

BLOCK = fp8.BLOCK[0]  # the weight block's side, the same along outputs and inputs (128)
NO_SHARED_FUSION = "--disable-shared-experts-fusion"


def _share(total: int, ranks: int) -> int | None:
    """``total`` split evenly over ``ranks`` (None: it does not split)."""
    return None if total % ranks else total // ranks


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer of a decoder layer as SGLang builds it over ``tp_size`` ranks; its
    properties are the arguments its FP8 ``create_weights`` receives on each rank (a partition
    None: the size does not split evenly over the ranks)."""

    name: str  # the module under a decoder layer, as SGLang names it ("mlp.gate_up_proj")
    projections: tuple[str, ...]  # the checkpoint's projections it loads, one per output
    input_size: int
    output_sizes: tuple[int, ...]  # each projection's output over all ranks
    tp_size: int
    row_parallel: bool = False  # split by its input (o_proj, down_proj), not its output

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    @property
    def input_size_per_partition(self) -> int | None:
        return _share(self.input_size, self.tp_size) if self.row_parallel else self.input_size

    @property
    def output_partition_sizes(self) -> tuple[int | None, ...]:
        return self.output_sizes if self.row_parallel else tuple(_share(o, self.tp_size) for o in self.output_sizes)

    def partitions(self) -> list[tuple[str, int, int | None]]:
        """``(what, size over all ranks, size per rank)`` of each partition SGLang requires to be a
        multiple of the block: a row-parallel layer's input at TP > 1; a column-parallel layer's
        outputs at TP > 1, and a merged layer's at any TP."""
        checked = []
        if self.row_parallel and self.tp_size > 1:
            checked.append(("input", self.input_size, self.input_size_per_partition))
        if not self.row_parallel and (self.tp_size > 1 or len(self.output_sizes) > 1):
            checked += [(f"{projection.rsplit('.', 1)[-1]} output", whole, part) for projection, whole, part
                        in zip(self.projections, self.output_sizes, self.output_partition_sizes)]
        return checked


@dataclass(frozen=True)
class ExpertLayer:
    """A decoder layer's routed experts as SGLang builds them on each rank (``FusedMoE``: the
    arguments of its FP8 ``create_weights``)."""

    projections: tuple[str, ...]  # the checkpoint's module names they hold ("mlp.experts")
    num_experts: int  # on each rank (routed, plus a fused shared expert)
    hidden_size: int
    intermediate_size: int
    moe_tp_size: int
    name: str = "mlp.experts"

    @property
    def intermediate_size_per_partition(self) -> int | None:
        return _share(self.intermediate_size, self.moe_tp_size)

    def partitions(self) -> list[tuple[str, int, int | None]]:
        return [("intermediate (gate/up output, down input)", self.intermediate_size,
                 self.intermediate_size_per_partition)]


Layer = Union[LinearLayer, ExpertLayer]


@dataclass(frozen=True)
class PlacedLayer:
    """One layer shape and the decoder layers that have it."""

    layers: tuple[int, ...]
    layer: Layer

    @property
    def broken(self) -> list[tuple[str, int, int | None]]:
        """The partitions SGLang refuses: not a multiple of the block, or not an even split."""
        return [(what, whole, size) for what, whole, size in self.layer.partitions() if size is None or size % BLOCK]

    @property
    def modules(self) -> list[str]:
        """The checkpoint's modules of these layers (``model.layers.<i>.<projection>``)."""
        return [f"model.layers.{i}.{projection}" for i in self.layers for projection in self.layer.projections]


def _row(name: str, input_size: int, output_size: int, tp: int) -> LinearLayer:
    return LinearLayer(name, (name,), input_size=input_size, output_sizes=(output_size,), tp_size=tp,
                       row_parallel=True)


def _mlp(prefix: str, hidden: int, intermediate: int, tp: int) -> list[Layer]:
    return [LinearLayer(f"{prefix}.gate_up_proj", (f"{prefix}.gate_proj", f"{prefix}.up_proj"), input_size=hidden,
                        output_sizes=(intermediate, intermediate), tp_size=tp),
            _row(f"{prefix}.down_proj", intermediate, hidden, tp)]


def shared_experts_fused(options: SGLangOptions) -> bool:
    """Whether SGLang serves a shared expert as one more routed expert (GLM-4.5's fusion: on CUDA,
    without expert parallelism, unless the extra arguments turn it off)."""
    return options.ep_size == 1 and NO_SHARED_FUSION not in options.extra_args


def sglang_layers(hf: HFModelConfig, tp: int, ep: int, fuse_shared_experts: bool) -> list[PlacedLayer]:
    """Every FP8-quantized layer shape SGLang builds for ``hf`` at TP ``tp`` and EP ``ep``."""
    h, heads, kv, d = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    every = tuple(range(hf.num_hidden_layers))
    kv_heads = max(kv, tp)  # fewer KV heads than ranks: each rank holds one, replicated
    qkv = LinearLayer("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      input_size=h, output_sizes=(heads * d, kv_heads * d, kv_heads * d), tp_size=tp)
    placed = [PlacedLayer(every, qkv), PlacedLayer(every, _row("self_attn.o_proj", heads * d, h, tp))]
    sparse = tuple(hf.moe_layers)
    dense = tuple(i for i in every if i not in sparse)
    placed += [PlacedLayer(dense, layer) for layer in _mlp("mlp", h, hf.intermediate_size, tp)] if dense else []
    if not sparse:
        return placed
    shared = hf.shared_expert_intermediate_size
    fused = bool(shared) and fuse_shared_experts and ep == 1
    experts = ExpertLayer(projections=("mlp.experts",) + (("mlp.shared_experts",) if fused else ()),
                          num_experts=hf.num_experts // ep + (shared // hf.moe_intermediate_size if fused else 0),
                          hidden_size=h, intermediate_size=hf.moe_intermediate_size, moe_tp_size=tp // ep)
    placed.append(PlacedLayer(sparse, experts))
    if shared and not fused:
        placed += [PlacedLayer(sparse, layer) for layer in _mlp("mlp.shared_experts", h, shared, tp)]
    return placed


def _span(layers: tuple[int, ...]) -> str:
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}–{layers[-1]}"
    return "layers " + ", ".join(map(str, layers))


def _sizes(placed: PlacedLayer, ranks: str) -> str:
    return "; ".join(f"{what} {whole} / {ranks} = {size if size is not None else 'no even split'}"
                     for what, whole, size in placed.layer.partitions())


def working_expert_parallelism(hf: HFModelConfig, tp: int) -> list[int]:
    """The ``rollout.sglang.ep_size`` values at TP ``tp`` whose expert partitions SGLang builds."""
    def builds(ep: int) -> bool:
        width = _share(hf.moe_intermediate_size, tp // ep)
        return width is not None and width % BLOCK == 0

    return [ep for ep in range(1, tp + 1) if tp % ep == 0 and hf.num_experts % ep == 0 and builds(ep)]


def quantized_layout(options: SGLangOptions, hf: HFModelConfig) -> QuantizedLayout | None:
    """What SGLang builds of ``hf``'s quantized layers at ``rollout.sglang``'s layout in FP8, what
    is served in bf16 instead, and what it cannot serve (None: the engine is not quantized)."""
    if options.quantization != "fp8":
        return None
    tp, ep = options.tp_size, options.ep_size
    where = f"rollout.sglang tp_size={tp}, ep_size={ep}"
    if hf.multi_latent_attention:
        return QuantizedLayout(where, refused=(
            f"rollout.sglang.quantization=fp8 is not supported for {hf.architecture} (multi-head latent attention): "
            "the FP8 weight rules name grouped-query attention's projections only; serve it unquantized",))
    if hf.is_moe and hf.num_experts % ep:
        return QuantizedLayout(where, refused=(
            f"rollout.sglang.ep_size={ep} does not divide the {hf.num_experts} experts: SGLang gives each expert-parallel "
            f"rank the same number; choose one of {working_expert_parallelism(hf, tp)}",))
    lines, refused, unquantized = [], [], []
    for placed in sglang_layers(hf, tp, ep, shared_experts_fused(options)):
        expert = isinstance(placed.layer, ExpertLayer)
        ranks = f"moe_tp {tp // ep} (tp {tp} // ep {ep})" if expert else f"tp {tp}"
        what = f"{placed.layer.name} of {_span(placed.layers)}: {_sizes(placed, ranks)}"
        if not placed.broken:
            lines.append(f"{what}: block FP8")
        elif expert:
            working = working_expert_parallelism(hf, tp)
            fix = (f"set rollout.sglang.ep_size to {' or '.join(map(str, working))}" if working else
                   f"no ep_size at tp_size={tp} works: change rollout.sglang.tp_size")
            refused.append(f"{what}: not a multiple of {BLOCK}, so SGLang builds no FP8 experts and refuses to "
                           f"start (whatever is left unquantized); {fix}")
        else:
            unquantized += placed.modules
            lines.append(f"{what}: not a multiple of {BLOCK}, served in bf16 (ignored_layers of the FP8 copy, "
                         "sent in bf16 at sync)")
    return QuantizedLayout(where, lines=tuple(lines), refused=tuple(refused), unquantized=tuple(unquantized))


def unquantized_modules(options: SGLangOptions, hf: HFModelConfig) -> tuple[str, ...]:
    """The checkpoint's modules SGLang serves in bf16 at ``options``' layout (see the module)."""
    layout = quantized_layout(options, hf)
    return () if layout is None else layout.unquantized
