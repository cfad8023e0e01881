"""SGLang's native HTTP protocol: request bodies from our requests, samples from its responses.

Field names and encodings are SGLang's (``/generate`` with ``input_ids``, ``sampling_params``,
``return_logprob``, ``return_routed_experts``; ``meta_info.output_token_logprobs`` as
``[logprob, token_id, text]`` triples, ``meta_info.routed_experts`` as base64 of raw int32 laid
out ``[prompt + response − 1, num_hidden_layers, top-k]`` — every layer of the model, dense ones
included — ``meta_info.finish_reason.type``, and ``meta_info.weight_versions``: spans
``{"version", "start", "end"}`` over the output tokens, more than one when a weight update reached
the request while it decoded).
"""

from __future__ import annotations

import base64

import torch

from bpo_megatron.models.routing import RoutingError, RoutingLayout
from bpo_megatron.rollout.types import ResponseSlot, Sample, SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def sampling_params(params: SamplingParams, seed: int | None) -> dict:
    body = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables top-k
        "max_new_tokens": params.max_new_tokens,
        "n": 1,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the trainer scores it like any other
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        body["sampling_seed"] = seed
    return body


def generate_body(items: list[ResponseSlot], *, capture_routing: bool) -> dict:
    """One batched ``/generate`` request body."""
    return {
        "rid": [item.rid for item in items],
        "input_ids": [list(item.request.prompt_tokens) for item in items],
        "sampling_params": [sampling_params(item.request.sampling, item.seed) for item in items],
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only
        "return_routed_experts": capture_routing,
        "routed_experts_start_len": 0,  # routing of the whole sequence, prompt included
    }


class ProtocolError(ValueError):
    """A response that does not match what was asked (never trained on)."""


def _version(reported) -> int:
    """SGLang's ``meta_info.weight_version``: the version string our updates send, or
    ``"default"`` (the server's flag default) for the checkpoint it started from (version 0)."""
    if reported in (None, "default"):
        return 0
    try:
        return int(reported)
    except (TypeError, ValueError):
        raise ProtocolError(f"meta_info.weight_version={reported!r} is not a version this trainer sent") from None


def token_versions(meta: dict, length: int, rid: str) -> torch.Tensor | None:
    """The weights version of each output token, from SGLang's ``meta_info.weight_versions`` (None
    from a server that does not report them). The spans must tile the response."""
    spans = meta.get("weight_versions")
    if spans is None:
        return None
    versions = torch.empty(length, dtype=torch.long)
    covered = 0
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != covered or end < start or end > length:
            raise ProtocolError(f"{rid}: meta_info.weight_versions {spans} do not tile its {length} response tokens")
        versions[start:end] = _version(span["version"])
        covered = end
    if covered != length:
        raise ProtocolError(f"{rid}: meta_info.weight_versions {spans} do not tile its {length} response tokens")
    return versions


def decode_sample(item: ResponseSlot, response: dict, *, routing: RoutingLayout | None) -> Sample:
    """A ``Sample`` from one element of SGLang's ``/generate`` response (with routed experts,
    as ``routing`` lays them out, when it is given)."""
    meta = response.get("meta_info") or {}
    if meta.get("id") not in (None, item.rid):
        raise ProtocolError(f"response for {meta.get('id')!r} where {item.rid!r} was expected")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ProtocolError(f"{item.rid}: meta_info.output_token_logprobs missing (was return_logprob sent?)")
    tokens = [int(t[1]) for t in triples]
    output_ids = response.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens:
        raise ProtocolError(f"{item.rid}: output_ids and output_token_logprobs disagree")
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    prompt = torch.tensor(item.request.prompt_tokens, dtype=torch.long)
    versions = token_versions(meta, len(tokens), item.rid)
    sample = Sample(
        request_id=item.request.request_id,
        index=item.index,
        prompt_tokens=prompt,
        response_tokens=torch.tensor(tokens, dtype=torch.long),
        rollout_logprobs=torch.tensor([float(t[0]) for t in triples], dtype=torch.float32),
        finish_reason=_FINISH.get(finish, "abort"),
        # the oldest weights that sampled a token of it (a partial rollout's staleness)
        weight_version=int(versions.min()) if versions is not None and len(tokens) else _version(
            meta.get("weight_version")),
        token_versions=versions,
    )
    if routing is not None:
        encoded = meta.get("routed_experts")
        if encoded is None:
            raise ProtocolError(
                f"{item.rid}: no routed experts in the response; start the server with "
                "--enable-return-routed-experts (rollout.capture_routed_experts=true)"
            )
        try:
            sample.routed_experts = routing.decode_int32(base64.b64decode(encoded), where=f"{item.rid}: routed_experts")
        except RoutingError as exc:
            raise ProtocolError(str(exc)) from exc
    try:
        sample.check(num_moe_layers=routing and routing.num_moe_layers, topk=routing and routing.topk)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc
    return sample
