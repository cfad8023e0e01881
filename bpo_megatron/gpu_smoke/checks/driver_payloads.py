"""Every value the trainer returns reaches a driver that has no GPU (a Slurm step with
``--gpus=0``, a KubeRay head): each one is searched for device tensors, pickled the way Ray does
(cloudpickle) and unpickled in a separate process in which CUDA is hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bpo_megatron.gpu_smoke.checks.trainer_offload import snapshot
from bpo_megatron.orchestration.host_values import device_tensors
from bpo_megatron.gpu_smoke.common import build_actor, single_rank_world
from bpo_megatron.testing import random_model_dir, random_tokens
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome

UNPICKLE_IN_A_DRIVER_WITHOUT_GPU = r"""
import json, pickle, sys
import torch
payloads = pickle.load(sys.stdin.buffer)
report = {"cuda_available": torch.cuda.is_available(), "loaded": {}, "failed": {}}
for name, blob in payloads.items():
    try:
        pickle.loads(blob)
        report["loaded"][name] = len(blob)
    except Exception as error:
        report["failed"][name] = f"{type(error).__name__}: {error}"[:300]
print(json.dumps(report))
"""


def _pickle(value: Any) -> bytes:
    try:
        import cloudpickle  # Ray's serialiser for task results
    except ImportError:
        import pickle as cloudpickle
    return cloudpickle.dumps(value)


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.trainer.samples import TrainSample

    out = Outcome("driver_payloads")
    config = profile.small_model
    hf = HFModelConfig.load(config)
    model_dir = random_model_dir(config, workdir / "small_moe", seed=0)
    gen = torch.Generator().manual_seed(3)
    samples = [TrainSample(tokens=torch.tensor(tokens), response_start=8,
                           rollout_logprobs=-torch.rand(24, generator=gen) * 3 - 6, advantage=(-1.0) ** i,
                           routed_experts=torch.rand(31, len(hf.moe_layers), hf.num_experts, generator=gen)
                           .argsort(-1)[..., :hf.num_experts_per_tok].to(torch.int32))
               for i, tokens in enumerate(random_tokens(4, 32, hf.vocab_size, seed=4))]
    returned: dict[str, Any] = {}
    with single_rank_world():
        actor = build_actor(profile, config, replay=True, micro_batch_size=2, weights=model_dir)
        returned["compute_logprobs"] = actor.compute_logprobs(samples)
        returned["compute_logprobs(record_routing)"] = actor.compute_logprobs(samples, record_routing=True)
        returned["train_step"] = actor.train_step(samples)
        returned["offload"] = actor.offload()
        returned["onload"] = actor.onload()
        checkpoint_error, differ = "", []
        try:  # the checkpoint round trip of this precision and optimizer is checked here too
            saved = snapshot(actor)
            returned["save"] = actor.save(str(workdir / "driver_checkpoints"))
            actor.train_step(samples)  # move away from the saved state, so the load must restore it
            returned["load"] = actor.load(returned["save"])
            loaded = snapshot(actor)
            differ = sorted(k for k in saved if not k.startswith("grad:") and not torch.equal(saved[k], loaded[k]))
        except Exception as error:  # noqa: BLE001 - reported as a failed criterion, the rest still runs
            import traceback

            checkpoint_error = f"{error!r}"
            out.notes.append(traceback.format_exc()[-3000:])
        actor.close()

    found = {name: device_tensors(value) for name, value in returned.items()}
    found = {name: hits for name, hits in found.items() if hits}
    blobs = {name: _pickle(value) for name, value in returned.items()}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the driver process sees no GPU
    import pickle

    child = subprocess.run([sys.executable, "-c", UNPICKLE_IN_A_DRIVER_WITHOUT_GPU], input=pickle.dumps(blobs),
                           capture_output=True, env=env, timeout=300)
    if child.returncode != 0:
        raise RuntimeError(f"the GPU-less driver process failed:\n{child.stderr.decode()[-3000:]}")
    report = json.loads(child.stdout.decode().strip().splitlines()[-1])
    out.numbers.update(values=len(returned), payload_bytes=sum(map(len, blobs.values())),
                       driver_sees_cuda=report["cuda_available"], loaded_in_driver=len(report["loaded"]))
    out.require(not report["cuda_available"], "the driver process has no usable GPU")
    out.require(not checkpoint_error, "save and load of a checkpoint (model, optimizer) work"
                + (f": {checkpoint_error}" if checkpoint_error else ""))
    out.require(not checkpoint_error and not differ,
                f"the load restores parameters and optimizer state bit for bit after a further step "
                f"({len(differ)} tensors differ{': ' + ', '.join(differ[:3]) if differ else ''})")
    out.require(not found, "no device tensor in any returned value"
                + ("" if not found else ": " + "; ".join(f"{k}: {', '.join(v[:3])}" for k, v in found.items())))
    out.require(not report["failed"], f"the GPU-less driver unpickles every value ({len(report['loaded'])} of "
                f"{len(returned)})" + ("" if not report["failed"] else ": " + "; ".join(
                    f"{k}: {v}" for k, v in report["failed"].items())))
    return out
