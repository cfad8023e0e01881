"""The vLLM rollout engine: an in-process ``vllm.LLM`` (GPU clusters; vLLM is imported lazily).

Requests go in as token ids, one vLLM request per response (``n`` responses of a request get
seeds ``seed + index``, as with SGLang), and come back as samples:

* **Log μ**: vLLM returns the log-prob of each sampled token with ``SamplingParams(logprobs=0)``.
  Which distribution it is taken from is the engine's ``logprobs_mode``: ``processed_logprobs`` is
  the log-softmax of the logits after temperature *and after* top-k/top-p masking (vLLM's sampler
  masks first, then reports); ``raw_logprobs`` is the log-softmax of the logits before temperature.
  The trainer recomputes log-softmax(logits / T) with no filter, so ``processed_logprobs`` (the
  default) is exact when top-k and top-p are off (the paper's setting, any T), and
  ``raw_logprobs`` when T = 1 (any filter). Other combinations are refused per request.
* **Stops**: only ``stop_token_ids`` end a response (``ignore_eos``, the list holds the tokenizer's
  end tokens already); the stop token stays in the response, as in the other engines.
* **R3**: engine argument ``enable_return_routed_experts``; each ``CompletionOutput.routed_experts``
  is a numpy array ``[prompt + response − 1, MoE layers, top-k]`` (uint8 with ≤ 256 experts). It
  needs vLLM's GPU model runner; vLLM on CPU generates but records nothing. The capture is
  engine-wide: a request that does not ask for its routing (``capture_routing=False``, evaluation)
  gets ``routed_experts=None``.
* **Weights**: Hugging Face on-disk names go to every worker through ``LLM.collective_rpc`` into
  the model's own ``load_weights`` (which fuses q/k/v, gate/up and the experts the way vLLM lays
  them out), then the prefix cache is reset so no KV computed with old weights is reused. vLLM on
  CPU prepacks its weights and ignores in-place loads: weight sync needs the GPU build.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from bpo_megatron.models.routing import RoutingError, RoutingLayout
from bpo_megatron.rollout.engine import EngineCapabilities, RolloutEngine
from bpo_megatron.rollout.vllm.options import LogprobsMode, VLLMConfig
from bpo_megatron.rollout.types import (
    EngineHealth,
    GenerationRequest,
    ProtocolError,
    ResponseSlot,
    Sample,
    SamplingParams,
    finish_reason,
    response_slots,
)
from bpo_megatron.weights.buckets import buckets, tensor_bytes

LOAD_WEIGHTS_RPC = "bpo_load_weights"  # method WeightLoadingExtension adds to vLLM's workers

# ---------------------------------------------------------------------------- translation
def check_logprobs_semantics(params: SamplingParams, mode: LogprobsMode) -> None:
    """Refuse settings under which vLLM's reported log-prob is not log-softmax(logits / T)."""
    filtered = params.top_k > 0 or params.top_p < 1.0
    if mode == "processed_logprobs" and filtered:
        raise ValueError(
            f"rollout.engine=vllm reports log-probs after top-k/top-p masking (logprobs_mode=processed_logprobs), "
            f"but the trainer's log π is unfiltered: use rollout.top_k=0 and rollout.top_p=1.0 (got top_k="
            f"{params.top_k}, top_p={params.top_p}), or logprobs_mode=raw_logprobs with temperature 1")
    if mode == "raw_logprobs" and params.temperature != 1.0:
        raise ValueError(
            f"rollout.engine=vllm with logprobs_mode=raw_logprobs reports log-probs before temperature; the "
            f"trainer's log π uses rollout.temperature={params.temperature}: use temperature 1.0 or "
            "logprobs_mode=processed_logprobs")


def sampling_kwargs(params: SamplingParams, seed: int | None, mode: LogprobsMode) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one response."""
    check_logprobs_semantics(params, mode)
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1 disables top-k in every vLLM version
        "max_tokens": params.max_new_tokens,
        # the sampled token's log-prob, and the k most likely tokens' when asked (score centering)
        "logprobs": params.top_logprobs,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,  # the stop list is complete; the model's own EOS must not end a row early
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if seed is not None:
        kwargs["seed"] = seed
    return kwargs


def _head(positions: list, k: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each position (vLLM's ranks 1 … k; the sampled token's entry
    besides them, of a lower rank, is not one of them) as ``[R, k]`` ids and log-probs."""
    ids, values = [], []
    for position in positions:
        ranked = sorted(((entry.rank, token, entry.logprob) for token, entry in (position or {}).items()
                         if entry.rank is not None and 1 <= entry.rank <= k))
        if [rank for rank, _, _ in ranked] != list(range(1, k + 1)):
            raise ProtocolError(f"{where}: a position does not give the {k} most likely tokens asked (logprobs={k})")
        ids.append([token for _, token, _ in ranked])
        values.append([float(logprob) for _, _, logprob in ranked])
    return (torch.tensor(ids, dtype=torch.int32).view(len(positions), k),
            torch.tensor(values, dtype=torch.float32).view(len(positions), k))


def _sampled_logprob(position: Any, token: int, where: str) -> float:
    """The sampled token's entry of one position (a ``dict[token_id, Logprob]``)."""
    entry = position.get(token) if position is not None else None
    if entry is None:
        raise ProtocolError(f"{where}: no log-prob for the sampled token {token} (was logprobs=0 requested?)")
    return float(entry.logprob)


def decode_routed_experts(array: Any, *, positions: int, routing: RoutingLayout, where: str) -> torch.Tensor:
    """``[positions, MoE layers, top-k]`` from vLLM's numpy routing of one response (in the
    layout's expert-id dtype).

    A row for the last sampled token (never fed back, so never routed) is dropped if present.
    """
    routed = np.asarray(array)
    if routed.ndim != 3 or routed.shape[0] not in (positions, positions + 1):
        raise ProtocolError(f"{where}: routed_experts has shape {tuple(routed.shape)}, expected "
                            f"{positions} (or {positions + 1}) rows = prompt + response − 1")
    try:
        return routing.select(routed[:positions], where=f"{where}: routed_experts")
    except RoutingError as exc:
        raise ProtocolError(str(exc)) from exc


def decode_output(row: ResponseSlot, output: Any, *, routing: RoutingLayout | None) -> Sample:
    """A ``Sample`` from one ``vllm.RequestOutput`` (its single ``CompletionOutput``), with its
    routed experts as ``routing`` lays them out when it is given and the request asked for them
    (``GenerationRequest.capture_routing``: vLLM records routing for every request of an engine
    started with it, so what a request did not ask for is neither required nor kept)."""
    if not row.request.capture_routing:
        routing = None
    where = f"request {row.request.request_id}/{row.index}"
    if len(output.outputs) != 1:
        raise ProtocolError(f"{where}: {len(output.outputs)} completions for one response")
    completion = output.outputs[0]
    prompt_ids = getattr(output, "prompt_token_ids", None)
    if prompt_ids is not None and list(prompt_ids) != list(row.request.prompt_tokens):
        raise ProtocolError(f"{where}: the output belongs to another prompt")
    tokens = [int(t) for t in completion.token_ids]
    positions = list(completion.logprobs or [])
    if len(positions) != len(tokens):
        raise ProtocolError(f"{where}: {len(positions)} log-prob positions for {len(tokens)} tokens")
    logprobs = [_sampled_logprob(p, t, where) for p, t in zip(positions, tokens)]
    stops = set(row.request.sampling.stop_token_ids)
    # vLLM checks the length cap before stop tokens; a stop token is a stop whenever it comes
    finish = "stop" if tokens and tokens[-1] in stops else finish_reason(completion.finish_reason)
    sample = Sample(
        request_id=row.request.request_id,
        index=row.index,
        prompt_tokens=torch.tensor(row.request.prompt_tokens, dtype=torch.long),
        response_tokens=torch.tensor(tokens, dtype=torch.long),
        rollout_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason=finish,
    )
    if row.request.sampling.top_logprobs:
        sample.sampler_head_ids, sample.sampler_head_logprobs = _head(positions, row.request.sampling.top_logprobs,
                                                                      where)
    if routing is not None:
        if completion.routed_experts is None:
            raise ProtocolError(f"{where}: no routed experts; vLLM must be built with enable_return_routed_experts "
                                "(rollout.capture_routed_experts=true) and run its GPU model runner")
        sample.routed_experts = decode_routed_experts(
            completion.routed_experts, positions=len(row.request.prompt_tokens) + len(tokens) - 1,
            routing=routing, where=where)
    return sample


# ---------------------------------------------------------------------------------- engine
class WeightLoadingExtension:
    """Mixed into vLLM's workers (``worker_extension_cls``): load tensors by Hugging Face name."""

    def bpo_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]  # the worker provides it
        device = next(model.parameters()).device
        model.load_weights(weights=((name, tensor.to(device)) for name, tensor in named_tensors))
        return len(named_tensors)


# The releases whose APIs this module calls as it calls them: 0.21 moved the prompt's rows of
# CompletionOutput.routed_experts to RequestOutput.prompt_routed_experts and refused routed-expert
# capture under its default async scheduling; 0.22 restored the whole array (uint8 / uint16).
# 0.33 is the newest release checked.
SUPPORTED_VLLM = ((0, 22), (0, 34))


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("rollout.engine=vllm needs vLLM: install bpo-megatron[vllm] on a CUDA machine") from exc
    version = getattr(vllm, "__version__", "0")
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    low, high = SUPPORTED_VLLM
    if not low <= release < high:
        raise ImportError(f"vLLM {version} is installed; rollout.engine=vllm supports {low[0]}.{low[1]} ≤ vLLM < "
                          f"{high[0]}.{high[1]} (the releases whose routed-expert output and engine arguments it "
                          "reads): install bpo-megatron[vllm]")
    return vllm


class VLLMEngine(RolloutEngine):
    """``VLLMEngine(model_dir, capture_routing=..., **VLLMConfig fields)``, or ``config=VLLMConfig(...)``."""

    def __init__(self, model_dir: str | None = None, *, capture_routing: bool = True,
                 config: VLLMConfig | None = None, **options: Any) -> None:
        from bpo_megatron.models.hf_config import HFModelConfig

        cfg = config or VLLMConfig(model_path=str(model_dir or ""), capture_routed_experts=capture_routing, **options)
        hf = HFModelConfig.load(cfg.model_path)
        capture = cfg.capture_routed_experts and hf.num_experts > 0  # dense models route nothing
        if capture != cfg.capture_routed_experts:
            cfg = replace(cfg, capture_routed_experts=capture)
        self.cfg = cfg
        self.routing = RoutingLayout.of(hf) if capture else None
        self.capabilities = EngineCapabilities(captures_routing=capture)
        self._vllm = _import_vllm()
        self._llm = self._vllm.LLM(**cfg.llm_kwargs())
        self._paused = False
        self.weight_version = self._pending_version = 0

    def _live(self):
        if self._llm is None:
            raise RuntimeError("the vllm rollout engine was shut down; create a new one")
        return self._llm

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        llm = self._live()
        if self._paused:
            raise RuntimeError("the vllm rollout engine is in a weight update; call end_weight_update()")
        rows = response_slots(requests)
        params = [self._vllm.SamplingParams(**sampling_kwargs(r.request.sampling, r.seed, self.cfg.logprobs_mode))
                  for r in rows]  # every row is checked before anything is generated
        prompts = [{"prompt_token_ids": list(r.request.prompt_tokens)} for r in rows]
        outputs = llm.generate(prompts, params, use_tqdm=False)  # in prompt order
        if len(outputs) != len(rows):
            raise ProtocolError(f"vLLM answered {len(outputs)} of {len(rows)} requests")
        samples = [decode_output(row, out, routing=self.routing) for row, out in zip(rows, outputs)]
        for sample in samples:
            sample.weight_version = self.weight_version
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        llm = self._live()
        sent = 0
        for bucket in buckets(((n, t.detach()) for n, t in named_tensors), self.cfg.weight_bucket_bytes):
            llm.collective_rpc(LOAD_WEIGHTS_RPC, args=(bucket,))
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return sent

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError("vLLM holds fused (and possibly TP-sharded) weights, not Hugging Face tensors: "
                                  "weight_sync.verify needs rollout.engine=hf")

    def begin_weight_update(self, version: int) -> None:
        self._live()
        self._paused, self._pending_version = True, int(version)

    def end_weight_update(self) -> None:
        llm = self._live()
        llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self._paused, self.weight_version = False, self._pending_version

    def health(self) -> EngineHealth:
        if self._llm is None:
            return EngineHealth(False, "shut down")
        return EngineHealth(True, "paused" if self._paused else "ready")

    def shutdown(self) -> None:
        self._llm = None  # vLLM's engine core and workers stop when the LLM is collected
        gc.collect()
