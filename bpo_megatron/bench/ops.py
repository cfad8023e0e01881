"""Benchmark: ATen ops and host syncs per training micro-batch and per optimizer step, before and
after each fast path of the local spec (``models.options.FAST_PATHS``): Megatron's modules, then the
fast paths turned on one after another (grouped-GEMM experts, fused attention, the sorted MoE
dispatch), each row with the ones before it. Micro-batches are packed (``thd``, one sample each).

The project's own train actor (world size 1 over gloo, fp32 on CPU, R3 replay, BPO) trains a
Qwen3-MoE with the kit throughput model's layer shape (``profiles`` large model: 32 experts top-4,
16 query / 4 key-value heads) at a small width and ``--layers`` layers: the number of ops a layer
issues does not depend on its width, so ops per layer carry over to the full-width model; the
whole-model counts scale with the layer count (the kit model has 16).

Counting: a ``TorchDispatchMode`` sees every ATen op below autograd, forward and backward (the CPU
autograd engine runs in the calling thread). Host syncs are counted as ``aten::_local_scalar_dense``
(``.item()``, ``int(t)``, ``bool(t)``: one scalar read each), ops whose output shape depends on the
data (``nonzero``, ``masked_select``, boolean-mask ``index``/``index_put_``, ``unique``,
``repeat_interleave`` without ``output_size``), and, at the Python level, ``Tensor.tolist`` /
``Tensor.cpu`` / ``Tensor.numpy`` calls (device-to-host copies on a GPU; free and invisible to the
dispatcher on CPU). Per micro-batch: the difference between a step of ``2k`` and a step of ``k``
identical-shaped micro-batches, divided by ``k``; per step: what a step of ``k`` micro-batches
costs beyond ``k`` micro-batches (optimizer, gradient reductions, batch preparation). Beside the
counts, ``parameters``: the parameter tensors of the model on the rank (each has its own gradient
hook and optimizer entry, host work per step that grows with their number, not with their size);
per layer, what one more layer adds.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing.models import qwen3_moe_config

MODEL: dict[str, Any] = qwen3_moe_config(  # the kit throughput model's layer shape (gpu_smoke.profiles), narrow
    router_aux_loss_coef=0.0,
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=16,
    num_key_value_heads=4, head_dim=16, num_hidden_layers=2, num_experts=32, num_experts_per_tok=4,
    vocab_size=1024, max_position_embeddings=4096)
SYNC_OPS = ("_local_scalar_dense",)
DATA_SHAPED_OPS = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                   "unique_dim", "repeat_interleave")
PY_SYNCS = ("tolist", "cpu", "numpy")


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ATen ops by name (overload packet), and data-shaped ops with boolean-mask indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.data_shaped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in DATA_SHAPED_OPS and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
            self.data_shaped += 1
        elif name in ("index", "index_put", "index_put_") and _has_bool_index(args):
            self.data_shaped += 1
        return func(*args, **kwargs)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class PythonSyncs:
    """Counts calls of ``Tensor.tolist/cpu/numpy`` while active (patched on the class)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> PythonSyncs:
        for name in PY_SYNCS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from TensorBase

            def counted(self_, *a, __name=name, __original=original, **k):
                self.calls[__name] += 1
                return __original(self_, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def _count(fn) -> dict[str, int]:
    with PythonSyncs() as py, OpCounter() as ops:
        fn()
    return {"ops": sum(ops.ops.values()), "mm": ops.ops["mm"] + ops.ops["addmm"] + ops.ops["bmm"],
            "grouped_mm": ops.ops["_grouped_mm"], "scalar_reads": sum(ops.ops[n] for n in SYNC_OPS),
            "data_shaped": ops.data_shaped, "tolist_cpu": sum(py.calls.values())}


def _measure(options: dict[str, str], model: dict, micro_batches: int, tokens: int) -> dict[str, dict[str, float]]:
    """On a world-size-1 gloo rank: counts per micro-batch and per step with the model ``options``."""
    from bpo_megatron.models import HFModelConfig, ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.testing.samples import random_routing
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.trainer.samples import TrainSample
    from bpo_megatron.trainer.spec import TrainerSpec

    hf = HFModelConfig.load(model)
    actor = TrainerSpec(
        hf=hf, parallel=ParallelConfig(),
        model=ModelOptions(routing_replay=True, params_dtype="fp32", **options),
        loss="bpo", optimizer=OptimizerSettings(lr=1e-4),
        trainer=TrainerConfig(micro_batch_size=1, max_tokens_per_micro_batch=tokens),  # packed, one sample each
    ).build()
    gen = torch.Generator().manual_seed(0)

    def samples(count: int) -> list:
        prompt = tokens // 4
        return [TrainSample(tokens=torch.randint(0, hf.vocab_size, (tokens,), generator=gen), response_start=prompt,
                            rollout_logprobs=-torch.rand(tokens - prompt, generator=gen) - 1.0,
                            advantage=1.0 if i % 2 else -1.0, routed_experts=random_routing(tokens - 1, hf, gen))
                for i in range(count)]

    actor.train_step(samples(micro_batches))  # warm-up: optimizer state, lazy buffers
    one = samples(micro_batches)
    two = samples(2 * micro_batches)
    small = _count(lambda: actor.train_step(one))
    large = _count(lambda: actor.train_step(two))
    parameters = {"parameters": float(len(list(actor.model.parameters())))}
    actor.close()
    per_mb = {k: (large[k] - small[k]) / micro_batches for k in small}
    per_step = {k: small[k] - micro_batches * per_mb[k] for k in small}
    return {"micro_batch": {**per_mb, **parameters}, "step_overhead": {**per_step, **parameters},
            "step": {**{k: float(v) for k, v in small.items()}, **parameters}}


def measure_with_layer(options: dict[str, str], model: dict, micro_batches: int, tokens: int
                       ) -> dict[str, dict[str, float]]:
    """:func:`_measure` of ``model`` and of the model one layer deeper (on this rank, one after the
    other), with ``"layer"``: what the extra layer adds per micro-batch."""
    base = _measure(options, model, micro_batches, tokens)
    deeper = _measure(options, {**model, "num_hidden_layers": model["num_hidden_layers"] + 1}, micro_batches, tokens)
    base["layer"] = {k: deeper["micro_batch"][k] - v for k, v in base["micro_batch"].items()}
    return base


COLUMNS = ("ops", "mm", "grouped_mm", "scalar_reads", "data_shaped", "tolist_cpu", "parameters")


def cumulative_variants() -> dict[str, dict[str, str]]:
    """Megatron's modules, then each fast path turned on in :data:`FAST_PATHS` order on top of the
    ones before it: label -> model options."""
    from bpo_megatron.models.options import FAST_PATHS, fast_path_options

    options = fast_path_options(on=False)
    variants = {"none (Megatron's modules)": dict(options)}
    for name, (on, _) in FAST_PATHS.items():
        options.update(on)
        variants[f"+ {name}"] = dict(options)
    return variants


def table(results: dict[str, dict], micro_batches: int) -> str:
    lines = [f"| fast paths | counted over | {' | '.join(COLUMNS)} |", "|---|---|" + "---:|" * len(COLUMNS)]
    for label, res in results.items():
        for part, what in (("micro_batch", "one micro-batch"),
                           ("layer", "one layer of a micro-batch"),
                           ("step_overhead", "a step beyond its micro-batches"),
                           ("step", f"a step of {micro_batches} micro-batches")):
            row = " | ".join(f"{res[part][c]:,.0f}" for c in COLUMNS)
            lines.append(f"| {label} | {what} | {row} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or argparse.ArgumentParser(prog="bench_ops", description=__doc__)
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"],
                        help="layers of the measured model (a model of one more layer gives the per-layer row)")
    parser.add_argument("--micro-batches", type=int, default=2, help="k: micro-batches of the smaller step")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sample (one sample per micro-batch)")
    parser.add_argument("--kit-layers", type=int, default=16, help="layer count to extrapolate to (the kit model's)")
    parser.add_argument("--all-fast-paths-only", action="store_true",
                        help="measure only the last row, every fast path on (one gloo world instead of four)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    results = {}
    variants = cumulative_variants()
    if args.all_fast_paths_only:
        variants = dict(list(variants.items())[-1:])
    for label, options in variants.items():
        (results[label],) = run_gloo_world(measure_with_layer, 1, options, {**MODEL, "num_hidden_layers": args.layers},
                                           args.micro_batches, args.tokens, timeout=1200)
    print(f"model: {args.layers} layers (and {args.layers + 1} for the per-layer row), {MODEL['num_experts']} experts "
          f"top-{MODEL['num_experts_per_tok']}, {MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads, "
          f"hidden {MODEL['hidden_size']}; one packed sample of {args.tokens} tokens per micro-batch; fp32 CPU, "
          "R3 replay, BPO")
    print(table(results, args.micro_batches))
    for label, res in results.items():
        mb, layer = res["micro_batch"], res["layer"]
        at_kit = {k: mb[k] + (args.kit_layers - args.layers) * layer[k] for k in COLUMNS}
        print(f"{label}: at {args.kit_layers} layers (extrapolated) {at_kit['ops']:,.0f} ops, {at_kit['mm']:,.0f} mm, "
              f"{at_kit['scalar_reads']:,.0f} scalar reads, {at_kit['data_shaped']:,.0f} data-shaped, "
              f"{at_kit['tolist_cpu']:,.0f} tolist/cpu per micro-batch; {at_kit['parameters']:,.0f} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
