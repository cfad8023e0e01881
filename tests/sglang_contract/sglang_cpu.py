"""The opening of a script that builds SGLang 0.5.23's own models on CPU, run with SGLang's Python:
one rank, a gloo group, SGLang's server arguments for the model directory given as the script's first
argument, the group's port as its last.

One thing is stubbed: the module ``vllm._custom_ops``, which the constructor of SGLang's rotary
embedding imports on a platform that is neither CUDA nor its CPU engine (that engine needs
``sgl_kernel``'s CPU build) to keep a fallback kernel it calls only in a forward; the scripts run none.
"""

ONE_RANK_CPU = r"""
import json, sys, types
import torch

vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
ops.rotary_embedding, vllm._custom_ops = None, ops
sys.modules.update({"vllm": vllm, "vllm._custom_ops": ops})

from transformers import AutoConfig
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import get_parallel, publish
from sglang.srt.server_args import ServerArgs

model_dir, port = sys.argv[1], sys.argv[-1]
publish(ServerArgs(model_path=model_dir, device="cpu", tp_size=1, skip_tokenizer_init=True), role="scheduler")
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method=f"tcp://127.0.0.1:{port}")
initialize_model_parallel(backend="gloo")
get_parallel().override_permanently(tp_rank=0, moe_ep_rank=0, moe_tp_rank=0, pp_rank=0, attn_tp_rank=0,
                                    attn_dp_rank=0)
"""
