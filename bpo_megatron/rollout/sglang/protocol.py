"""SGLang's native HTTP protocol: request bodies from our requests, samples from its responses.

Field names and encodings are SGLang's (``/generate`` with ``input_ids``, ``sampling_params``,
``return_logprob``, ``return_routed_experts``, ``top_logprobs_num``; ``meta_info.output_token_logprobs``
as ``[logprob, token_id, text]`` triples, the top log-probs as flat base64 arrays
(``return_flat_raw_output_top_logprobs``) or ``meta_info.output_top_logprobs``, one list of such
triples per output token, most likely first, ``meta_info.routed_experts`` as base64 of raw int32 laid
out ``[prompt + response − 1, num_hidden_layers, top-k]`` — every layer of the model, dense ones
included — ``meta_info.finish_reason.type``, ``meta_info.cached_tokens`` (the prompt tokens the radix cache
supplied), and ``meta_info.weight_versions``: spans
``{"version", "start", "end"}`` over the output tokens, more than one when a weight update reached
the request while it decoded).

A request paused for a weight update (``/pause_generation``) and continued may report routed
experts that did not sample its earlier tokens, depending on the pause mode
(:data:`REPREFILLED_BY_PAUSE`); :func:`routing_valid` marks which tokens keep their own.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bpo_megatron.models.routing import RoutingError, RoutingLayout
from bpo_megatron.rollout.types import ProtocolError, ResponseSlot, Sample, SamplingParams, finish_reason


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


def returns_routing(item: ResponseSlot, capture_routing: bool) -> bool:
    """Whether ``item``'s routed experts are asked of the server: the engine captures
    (``capture_routing``) and the request wants them (evaluation's do not)."""
    return capture_routing and item.request.capture_routing


def generate_body(items: list[ResponseSlot], *, capture_routing: bool) -> dict:
    """One batched ``/generate`` request body. ``capture_routing``: the engine captures routed
    experts; they are asked for when some item's request wants them (SGLang takes one flag per
    body; the client posts one item per body, so each request gets exactly what it asked for, and
    :func:`decode_sample` ignores routing sent for an item that did not ask). Routing is asked
    from the items' ``routing_from`` on (one value per body, as SGLang takes it)."""
    starts = {item.request.routing_from for item in items}
    if len(starts) != 1:
        raise ValueError(f"one /generate body takes one routed_experts_start_len; these items ask {sorted(starts)}")
    body = {
        "rid": [item.rid for item in items],
        "input_ids": [list(item.request.prompt_tokens) for item in items],
        "sampling_params": [sampling_params(item.request.sampling, item.seed) for item in items],
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only
        "return_routed_experts": any(returns_routing(item, capture_routing) for item in items),
        # the positions from there on (0: the whole sequence, prompt included)
        "routed_experts_start_len": starts.pop(),
    }
    if any(item.request.sampling.top_logprobs for item in items):  # score centering's sampler top-k
        body["top_logprobs_num"] = [item.request.sampling.top_logprobs for item in items]
        # as base64 float32 values and int32 ids on the finished response (8 bytes an entry, 11 in
        # base64), not one [logprob, id, null] JSON triple an entry (≈ 25 bytes, and ≈ 200 bytes
        # of Python objects while parsed): 32 per token of a 16k-token response is 5.6 MB, not 13
        body["return_flat_raw_output_top_logprobs"] = True
        body["return_flat_raw_top_logprobs_b64"] = True
    return body


# Whether a ``/pause_generation`` mode makes SGLang recompute the routed experts of a request it
# paused, once generation continues (SGLang 0.5.23). ``retract`` frees the request's KV cache
# (``Req.reset_for_retract`` in managers/schedule_batch.py drops its recorded experts too) and
# prefills prompt + output again with the weights of that moment, so every position reports the
# experts of the request's last weights version. ``in_place`` keeps the cache, so each position
# keeps the experts of the weights that processed it (but SGLang's cache flush after a weight
# update fails while requests sit in place, so the engine pauses with ``retract``).
REPREFILLED_BY_PAUSE = {"retract": True, "in_place": False}


def reprefills(pause_mode: str) -> bool:
    """Whether continuing after a pause in ``pause_mode`` recomputes a request's routed experts."""
    if pause_mode not in REPREFILLED_BY_PAUSE:
        raise ValueError(f"pause mode {pause_mode!r}: what it does to routed experts is known for "
                         f"{sorted(REPREFILLED_BY_PAUSE)} only")
    return REPREFILLED_BY_PAUSE[pause_mode]


def routing_valid(versions: torch.Tensor, pause_mode: str) -> torch.Tensor | None:
    """For each output token (``versions``: the weights version that sampled it), whether the
    routed experts SGLang reports are those it was sampled with; None when all are.

    Under a re-prefilling pause every update a request spans re-prefills it, so a token sampled by
    version v saw the routing of v at every earlier position; the response reports the routing of
    the last version only, which did not sample the tokens of older versions."""
    if not reprefills(pause_mode) or not versions.numel():
        return None
    valid = versions == versions[-1]
    return None if bool(valid.all()) else valid


def space_retractions(meta: dict, versions: torch.Tensor | None, pause_mode: str) -> int:
    """How often SGLang retracted a request for KV space (``meta_info.num_retractions`` counts
    every retraction; under a re-prefilling pause each weight update the request spanned is one
    of them, a version change in its ``weight_versions``). Such a request is re-prefilled with the
    same weights and its earlier routing replaced by the re-prefill's (other batch, other kernels)."""
    retractions = int(meta.get("num_retractions") or 0)
    if reprefills(pause_mode) and versions is not None and versions.numel() > 1:
        retractions -= int((versions[1:] != versions[:-1]).sum())
    return max(retractions, 0)


# SGLang's Prometheus counter of the requests its scheduler retracted for KV space (decode
# retractions; a pause's retractions are not counted there), exposed at /metrics with --enable-metrics
SPACE_RETRACTIONS_METRIC = "sglang:num_retracted_requests_total"


def space_retractions_total(exposition: str) -> float | None:
    """The server's space retractions so far from its ``/metrics`` text (summed over the ranks
    that report; None when the counter is not there: metrics off)."""
    values = [float(line.rsplit(None, 1)[1]) for line in exposition.splitlines()
              if line.startswith(SPACE_RETRACTIONS_METRIC) and line[len(SPACE_RETRACTIONS_METRIC):][:1] in ("{", " ")]
    return sum(values) if values else None


@dataclass(frozen=True)
class Pause:
    """A re-prefilling pause of the server for a weight update: the ``version`` it brought, and
    the server's space retractions so far read while it was paused (None: not reported)."""

    version: int
    space_retractions: float | None


def retracted_before_output(residual: int, versions: torch.Tensor | None, pauses: Sequence[Pause],
                            space_retractions_now: Callable[[], float | None] | None) -> bool:
    """Whether a request's ``residual`` retractions (those its ``weight_versions`` do not show) can
    only be pauses' retractions of it before its first output token — SGLang's ``retract`` pause
    retracts a request still in chunked prefill, which has no token yet to carry the version
    change — and so cost no token its routing. ``pauses``: the server's pauses since the request
    was posted. Those before its first token are the ones that brought a version up to its first
    token's; each retracts it once at most. A retraction for KV space needs output (SGLang retracts
    decoding requests), so it would come after the last of them: if the server's space retractions
    read now are as many as while that pause held it, there was none."""
    if residual <= 0 or versions is None or not versions.numel() or space_retractions_now is None:
        return False
    before = [pause for pause in pauses if pause.version <= int(versions[0])]
    if not before or residual > len(before) or before[-1].space_retractions is None:
        return False
    return space_retractions_now() == before[-1].space_retractions


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


def _top_logprobs(meta: dict, length: int, k: int, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's top-k per output token as ``[length, k]`` ids (int32) and log-probs
    (float32), most likely first: from the flat base64 arrays asked for
    (``output_top_logprobs_{val,idx}_flat_b64``, ``output_top_logprobs_shape``,
    ``output_top_logprobs_null_prefix``), or from ``meta_info.output_top_logprobs`` (one list of
    ``[logprob, token_id, text]`` per output token), which SGLang sends when it cannot make the
    flat form."""
    if "output_top_logprobs_val_flat_b64" in meta:
        return _flat_top_logprobs(meta, length, k, rid)
    positions = meta.get("output_top_logprobs")
    if positions is None or len(positions) != length:
        raise ProtocolError(f"{rid}: meta_info.output_top_logprobs has {None if positions is None else len(positions)} "
                            f"entries for {length} output tokens (was top_logprobs_num={k} sent?)")
    if any(entries is None or len(entries) < k for entries in positions):
        raise ProtocolError(f"{rid}: meta_info.output_top_logprobs gives fewer than the {k} tokens asked at a position")
    ids = torch.tensor([[int(entry[1]) for entry in entries[:k]] for entries in positions], dtype=torch.int32)
    values = torch.tensor([[float(entry[0]) for entry in entries[:k]] for entries in positions], dtype=torch.float32)
    return ids.view(length, k), values.view(length, k)


# SGLang's dtype markers of the flat base64 top log-probs, and the dtypes they decode into
_FLAT_DTYPES = {"output_top_logprobs_val_flat_b64": ("float32", torch.float32),
                "output_top_logprobs_idx_flat_b64": ("int32", torch.int32)}


def _flat_top_logprobs(meta: dict, length: int, k: int, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape, null_prefix = meta.get("output_top_logprobs_shape"), meta.get("output_top_logprobs_null_prefix", 0)
    if null_prefix or shape is None or list(shape)[0] != length or list(shape)[1] < k:
        raise ProtocolError(f"{rid}: output_top_logprobs_shape {shape} (null prefix {null_prefix}) for {length} output "
                            f"tokens with {k} asked at each")
    arrays = []
    for field, (marker, dtype) in _FLAT_DTYPES.items():
        if meta.get(f"{field}_dtype", marker) != marker:
            raise ProtocolError(f"{rid}: {field} comes as {meta.get(f'{field}_dtype')}, not {marker}")
        raw = base64.b64decode(meta.get(field) or "")
        if len(raw) != shape[0] * shape[1] * 4:
            raise ProtocolError(f"{rid}: {field} holds {len(raw)} bytes, not the {shape[0]} × {shape[1]} × 4 of its shape")
        # little-endian, as SGLang writes them (numpy's tobytes on the hosts it runs on)
        arrays.append(torch.frombuffer(bytearray(raw), dtype=dtype).view(shape[0], shape[1])[:, :k].contiguous())
    values, ids = arrays
    return ids, values


def decode_sample(item: ResponseSlot, response: dict, *, routing: RoutingLayout | None,
                  pause_mode: str = "retract", pauses: Sequence[Pause] = (),
                  space_retractions_now: Callable[[], float | None] | None = None) -> Sample:
    """A ``Sample`` from one element of SGLang's ``/generate`` response (with routed experts,
    as ``routing`` lays them out, when it is given and the item's request asked for them
    (``GenerationRequest.capture_routing``), and which tokens they sampled, for a server paused
    with ``pause_mode``: by default the engine's ``PAUSE_MODE``, which a test holds equal).
    ``pauses``: the server's pauses since the request was posted, and ``space_retractions_now``
    its space retractions so far, read when asked (:func:`retracted_before_output`; without them
    a retraction the versions do not show counts as one for space)."""
    if not item.request.capture_routing:
        routing = None  # not asked for: none is required, and any sent is not kept
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
        finish_reason=finish_reason(finish),
        # the oldest weights that sampled a token of it (a partial rollout's staleness)
        weight_version=int(versions.min()) if versions is not None and len(tokens) else _version(
            meta.get("weight_version")),
        token_versions=versions,
        # the prompt tokens its first prefill took from the radix cache (SGLang counts it once: a
        # retraction's re-prefill does not change it)
        cached_tokens=None if meta.get("cached_tokens") is None else int(meta["cached_tokens"]),
    )
    if item.request.sampling.top_logprobs:
        sample.sampler_head_ids, sample.sampler_head_logprobs = _top_logprobs(
            meta, len(tokens), item.request.sampling.top_logprobs, item.rid)
    if routing is not None:
        encoded = meta.get("routed_experts")
        if encoded is None:
            raise ProtocolError(
                f"{item.rid}: no routed experts in the response; start the server with "
                "--enable-return-routed-experts (rollout.capture_routed_experts=true)"
            )
        try:
            sample.routed_experts = routing.decode_int32(base64.b64decode(encoded), where=f"{item.rid}: routed_experts")
            sample.routing_start = item.request.routing_from
        except RoutingError as exc:
            raise ProtocolError(str(exc)) from exc
        if versions is None and reprefills(pause_mode):
            raise ProtocolError(
                f"{item.rid}: routed experts without meta_info.weight_versions: a request paused with "
                f"{pause_mode!r} reports the routing of its last weights for every token, and without each token's "
                "version the tokens sampled with other routing cannot be told apart (SGLang >= 0.5.23 sends them)")
        if versions is not None:
            sample.routing_valid = routing_valid(versions, pause_mode)
        residual = space_retractions(meta, versions, pause_mode)
        if residual > 0 and len(tokens) and not (reprefills(pause_mode) and retracted_before_output(
                residual, versions, pauses, space_retractions_now)):
            sample.retracted_for_space = True
            sample.routing_valid = torch.zeros(len(tokens), dtype=torch.bool)
    try:
        sample.check(num_moe_layers=routing and routing.num_moe_layers, topk=routing and routing.topk)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc
    return sample
