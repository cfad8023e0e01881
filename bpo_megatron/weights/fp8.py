"""FP8 weights for rollouts: the one place that decides how a weight is quantized.

Block-wise e4m3 (``torch.float8_e4m3fn``), as FP8 checkpoints of DeepSeek-V3 and Qwen3 are served
by SGLang (``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}``):
each 128 × 128 block of a weight ``[out, in]`` is scaled by ``amax(|block|) / 448`` (448: e4m3's
largest finite value) and rounded to e4m3; the block's scale is kept as ``weight_scale_inv``
``[ceil(out / 128), ceil(in / 128)]`` in fp32, and the weight is ``e4m3 × weight_scale_inv``. A
partial block at the edge is scaled by its own entries.

Quantized are the linear layers' weights (attention q, k, v, o; the MLP's and every expert's
gate, up and down projections), as FP8 serving quantizes them; the embeddings, the output layer,
the norms and the MoE router stay in the engine's precision (the router's choice is what R3
replays, so it is not rounded here).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
# an e4m3 number carries 3 mantissa bits: rounding moves a value by at most half a step, 2^-4 of it
# (relative), and values below the smallest normal (2^-6 of the scale) by at most 2^-10 of the scale
RELATIVE_ROUNDING = 2.0**-4
SUBNORMAL_STEP = 2.0**-9

# the Hugging Face names of the weights FP8 serving quantizes: attention's projections, the MLPs',
# the routed experts' and the shared experts' (GLM-4.5); a router's "mlp.gate.weight" is not one
_QUANTIZED = re.compile(r"\.(self_attn\.(q|k|v|o)_proj|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)"
                        r"\.weight$")


# An FP8-serialized checkpoint (SGLang's --quantization fp8, block scales): each quantized weight
# "<...>_proj.weight" beside its scales "<...>_proj.weight_scale_inv", and this in its config
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}


def quantized(name: str, unquantized: Collection[str] = ()) -> bool:
    """Whether the weight of Hugging Face name ``name`` is held in FP8 by an FP8 engine;
    ``unquantized``: modules (``model.layers.<i>.<projection>``) the engine serves in its dtype
    instead (a server that cannot build them in FP8 at its layout)."""
    return bool(_QUANTIZED.search(name)) and name.removesuffix(".weight") not in unquantized


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _per_element(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale spread over its entries (edge blocks cut to the weight's shape)."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weight, weight_scale_inv)`` of a 2-D weight, block by block (see the module)."""
    if weight.ndim != 2:
        raise ValueError(f"block-wise FP8 quantizes 2-D weights [out, in], got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = _blocks(rows, cols, block)
    padded = torch.zeros(br * block[0], bc * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    amax = padded.abs().view(br, block[0], bc, block[1]).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # an all-zero block stays zero
    scaled = weight.float() / _per_element(scale, weight.shape, block)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 engine computes with: ``e4m3 × weight_scale_inv`` per block."""
    return (q.float() * _per_element(scale_inv, q.shape, block)).to(dtype)


def round_through_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``weight`` as an FP8 engine holds it, back in ``weight``'s dtype: quantized and dequantized
    with the same scales (what a CPU engine computes with to emulate FP8 serving exactly)."""
    return dequantize(*quantize(weight, block), block, dtype=weight.dtype)


def round_named(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rounded through FP8 when the weight ``name`` is one FP8 serving quantizes; the
    experts' per-expert weights ``[out, in]`` are 2-D like any linear layer's."""
    return round_through_fp8(tensor) if quantized(name) else tensor


# -- FP8 GEMMs: activations in 1 × 128 groups, weights in 128 × 128 blocks (SGLang's w8a8 block FP8) --

GROUP = 128  # an activation row's entries share a scale per 128 consecutive input features


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 x, scale)`` of activations ``[rows, in]``, one scale per row and ``group`` input
    features (``amax / 448``; an all-zero group keeps scale 1; a partial last group is scaled by
    its own entries), as FP8 serving quantizes a linear layer's input on the fly."""
    rows, cols = x.shape
    groups = math.ceil(cols / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (padded / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(rows, groups * group)[:, :cols]
    return q, scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The activations an FP8 GEMM multiplies: ``e4m3 × scale`` per row and group."""
    return (q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]).to(dtype)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., in]``) rounded through e4m3 in 1 × 128 groups along its last dimension, back in
    its dtype: the input an FP8 GEMM sees, for GEMMs emulated in a wider dtype."""
    flat = x.reshape(-1, x.shape[-1])
    return dequantize_activations(*quantize_activations(flat), dtype=x.dtype).view(x.shape)


def emulated_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` as a w8a8 block FP8 GEMM computes it, on any device: the input rounded through
    e4m3 in 1 × 128 groups, the weight ``e4m3 × weight_scale_inv``, products summed in fp32, the
    result in ``x``'s dtype (the exact emulation the fast path is checked against)."""
    return (dequantize_activations(*quantize_activations(x)) @ dequantize(q, scale_inv).t()).to(x.dtype)


def gemm_path(x: torch.Tensor, q: torch.Tensor) -> str:
    """How :func:`linear` multiplies ``x`` by the FP8 weight ``q``: ``scaled_mm`` (one block-scaled
    ``torch._scaled_mm``) on a GPU that has that kernel (:func:`bpo_megatron.platform.has_fp8_block_gemm`:
    Hopper), for a bf16 input whose shapes it takes — input features a multiple of 512 (the weight's
    scale blocks along them a multiple of 4), output features a multiple of 128, rows a multiple of 16
    (its 16-byte alignment) —; ``emulated`` (:func:`emulated_linear`, the same rounding) otherwise."""
    from bpo_megatron import platform

    fits = x.shape[1] % (4 * GROUP) == 0 and q.shape[0] % BLOCK[0] == 0 and x.shape[0] % 16 == 0
    return "scaled_mm" if platform.has_fp8_block_gemm(x.device) and x.dtype == torch.bfloat16 and fits \
        else "emulated"


def linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` in FP8 with ``W = e4m3 q × weight_scale_inv`` (``[out, in]``, 128 × 128 blocks),
    the input quantized in 1 × 128 groups, accumulated in fp32, returned in ``x``'s dtype; by the
    path :func:`gemm_path` names."""
    if gemm_path(x, q) == "scaled_mm":
        return block_scaled_mm(*quantize_activations(x), q, scale_inv, x.dtype)
    return emulated_linear(x, q, scale_inv)


def block_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The block-scaled GEMM of :func:`linear` alone, on inputs already quantized (the path
    ``scaled_mm`` of :func:`gemm_path`: Hopper)."""
    # the kernel wants the activations' scales outer-dimension-major and the weight's transposed
    return torch._scaled_mm(xq, q.t(), x_scale.t().contiguous().t(), scale_inv.t(), out_dtype=out_dtype)


# -- weights for FP8 engines: what the trainer sends, what a server starts from --

def served_tensors(name: str, tensor: torch.Tensor, unquantized: Collection[str] = ()
                   ) -> list[tuple[str, torch.Tensor]]:
    """The tensors an FP8-serialized server loads for the weight ``name`` (SGLang with a block-FP8
    checkpoint): a quantized weight as its e4m3 values and ``<name>_scale_inv``, any other (and
    the modules ``unquantized``) as it is."""
    if not quantized(name, unquantized):
        return [(name, tensor)]
    q, scale_inv = quantize(tensor)
    return [(name, q), (name + SCALE_SUFFIX, scale_inv)]


# how the trainer sends weights to an engine that holds them in FP8 (EngineSpec.weight_quantization):
# "fp8": rounded through e4m3 in the tensor's dtype (an engine that computes in it: the embedded
# engine's emulation); "fp8-blocks": e4m3 values and their scales (an FP8-serialized server). Each
# takes (name, tensor, the modules the engine serves unquantized).
SYNC_FORMS: dict[str, Callable[[str, torch.Tensor, Collection[str]], list[tuple[str, torch.Tensor]]]] = {
    "fp8": lambda name, tensor, unquantized: [
        (name, round_through_fp8(tensor) if quantized(name, unquantized) else tensor)],
    "fp8-blocks": served_tensors,
}


@dataclass(frozen=True)
class SyncQuantization:
    """How the trainer sends weights to engines that hold them quantized: the form
    (:data:`SYNC_FORMS`) and the modules they serve in their dtype all the same
    (``model.layers.<i>.<projection>``: a server's layers it cannot build in FP8 at its layout)."""

    form: str
    unquantized: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.form not in SYNC_FORMS:
            raise ValueError(f"weights quantized as {self.form!r}: choose one of {sorted(SYNC_FORMS)}")
        object.__setattr__(self, "unquantized", frozenset(self.unquantized))

    def tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What the engines load for the weight ``name``."""
        return SYNC_FORMS[self.form](name, tensor, self.unquantized)


def quantization_config(unquantized: Collection[str] = ()) -> dict:
    """The ``quantization_config`` of a block-FP8 checkpoint whose modules ``unquantized`` stay in
    the model's dtype: listed as ``ignored_layers``, the key SGLang's ``Fp8Config`` reads."""
    config = dict(QUANTIZATION_CONFIG)
    if unquantized:
        config["ignored_layers"] = sorted(unquantized)
    return config


def _partial_name(target: Path) -> str:
    """A name for a copy under way no other process, on this node or another sharing the
    directory, picks: the node's name, the process and a random part."""
    return f"{target.name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _held(target: Path, wanted: dict) -> bool:
    """Whether ``target`` is a finished copy with the quantization ``wanted`` (raises when it
    was made for another one: the engines' layout changed since)."""
    if not (target / "config.json").is_file():
        return False
    made = json.loads((target / "config.json").read_text()).get("quantization_config")
    if made != wanted:
        raise ValueError(f"the block-FP8 copy {target} was made with quantization_config {made}, but the engines now "
                         f"need {wanted} (their rollout.sglang layout changed): remove {target}, or set "
                         "rollout.sglang.fp8_checkpoint_dir to another directory")
    return True


def served_checkpoint(model_dir: str | Path, directory: str | Path | None = None, unquantized: Collection[str] = (),
                      timeout_s: float = 1800.0) -> Path:
    """The block-FP8 checkpoint an FP8 server starts from: ``model_dir``'s weights through
    :func:`served_tensors` (the modules ``unquantized`` left as they are), its config with
    :func:`quantization_config`, its other files as they are; made once as
    ``<directory>/<model_dir's name>.fp8`` (``directory`` None: beside ``model_dir``) and reused.

    One engine per node makes it: the others wait on a lock file beside it for at most
    ``timeout_s`` (``rollout.sglang.fp8_copy_timeout_s``), then find it made. It is written under a
    name unique to its node and process and renamed into place at the end, so nodes that share the
    directory without sharing its lock agree too (the first rename wins, the others drop theirs)."""
    from bpo_megatron.weights.safetensors_io import INDEX_FILE, HFWeightsReader, ShardedSafetensorsWriter

    source = Path(model_dir)
    parent = source.parent if directory is None else Path(directory)
    target = parent / f"{source.name}.fp8"
    wanted = quantization_config(unquantized)
    if _held(target, wanted):
        return target
    if not os.access(parent if parent.exists() else parent.parent, os.W_OK):
        raise PermissionError(f"the block-FP8 copy of {source} for an FP8 server goes to {parent}, which is not "
                              "writable: set rollout.sglang.fp8_checkpoint_dir to a writable directory")
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{target.name}.lock", "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another engine did not finish the block-FP8 copy {target} within "
                                       f"{timeout_s:.0f} s (rollout.sglang.fp8_copy_timeout_s; its lock: "
                                       f"{lock.name})") from None
                time.sleep(1.0)
        if _held(target, wanted):  # made while this one waited
            return target
        partial = parent / _partial_name(target)
        try:
            shutil.copytree(source, partial, ignore=shutil.ignore_patterns("*.safetensors", INDEX_FILE))
            writer = ShardedSafetensorsWriter(partial)
            with HFWeightsReader(source) as reader:
                for name in reader.weight_map:
                    for served, tensor in served_tensors(name, reader.slice(name)[:], unquantized):
                        writer.add(served, tensor)
            writer.close()
            config = json.loads((partial / "config.json").read_text())
            config["quantization_config"] = wanted
            (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            os.rename(partial, target)
        except OSError:
            if not _held(target, wanted):  # not another node's copy landing first: a real failure
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target
