"""Settings of the SGLang rollout engine: the ``rollout.sglang`` section (:class:`SGLangOptions`)
and one engine's full configuration (:class:`SGLangConfig`: the options plus its checkpoint,
port and whether it captures routing, which the run decides)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Literal

from bpo_megatron.weights.buckets import DEFAULT_BUCKET_BYTES

# SGLang's spellings of the expert-parallel size (--ep-size and its aliases): rollout.sglang.ep_size's
EP_FLAGS = frozenset({"--ep-size", "--ep", "--expert-parallel-size"})


@dataclass(frozen=True)
class SGLangOptions:
    """How to start (or reach) the SGLang servers and talk to them (``rollout.sglang``).

    ``url`` attaches to a running server instead of starting one. ``host``: the address a started
    server binds; None (the default): its node's address as the cluster reaches it (what Ray
    knows the engine's node by), which is also the address the trainer is given. ``0.0.0.0``
    binds every interface and advertises the node's address; a loopback address is reachable from
    its own node only. ``port``: engine ``i`` listens on ``port + i``; None (the default): on a
    port found free each time a server starts. How weights
    reach the servers follows the placement (``cluster.colocate``), not a setting here: CUDA IPC
    handles on the trainer's GPUs, an NCCL broadcast on their own (:mod:`bpo_megatron.weight_sync`).
    """

    url: str | None = None
    host: str | None = None
    port: int | None = None
    tp_size: int = 1  # GPUs (tensor-parallel ranks) one server spans
    # expert parallelism inside an engine (SGLang's --ep-size, a divisor of tp_size): each rank holds
    # num_experts / ep_size whole experts and splits each over tp_size / ep_size ranks (moe_tp_size).
    # FP8 needs moe_intermediate_size / moe_tp_size a multiple of 128 (rollout/sglang/fp8_layout.py)
    ep_size: int = 1
    # the share of each GPU the server reserves for weights and KV cache (--mem-fraction-static);
    # None: SGLang's own choice
    mem_fraction_static: float | None = None
    extra_args: tuple[str, ...] = ()  # passed to sglang.launch_server verbatim
    # none: the weights as the trainer holds them; fp8: served in block FP8 (--quantization fp8 on a
    # block-FP8 checkpoint made from the run's weights, bpo_megatron/weights/fp8.py), the trainer
    # sending each linear weight as e4m3 values and block scales
    quantization: Literal["none", "fp8"] = "none"
    # where the block-FP8 copy of the run's weights is made for fp8 (None: beside them, e.g.
    # <run>/initial_hf.fp8 or <model.path>.fp8)
    fp8_checkpoint_dir: str | None = None
    # the command that starts a server, its first element the server's Python (default: this
    # interpreter, -m sglang.launch_server); the engine appends the model, address and options
    launcher: tuple[str, ...] = field(default_factory=lambda: (sys.executable, "-m", "sglang.launch_server"))
    startup_timeout_s: float = 900.0  # how long a started server may take to answer its health check
    # fp8 only, added to the start bound: SGLang compiles DeepGEMM's block-FP8 kernels for every
    # GEMM shape at start-up the first time on a node (its own warning: typically 10-20 minutes;
    # cached under SGLANG_DG_CACHE_DIR after), inside the server's wait for /health
    deep_gemm_compile_s: float = 1800.0
    # fp8 only, added to the start bound: making the block-FP8 copy of the weights before the server
    # starts, once per node (fp8.served_checkpoint: the whole checkpoint read and written, e.g. 61 GB
    # read and 31 GB written for Qwen3-30B-A3B), or waiting for another engine of the node making it
    fp8_copy_timeout_s: float = 1800.0
    # A generation request's own deadline. None (the default): none — a request waits in SGLang's
    # queue as long as the queue is long (a deadline would count that wait, and a retry restarts
    # the response from token 0 at the back of the queue); a server that stops making progress is
    # found by rollout.stall_timeout_s (decoding steps) and replaced.
    request_timeout_s: float | None = None
    max_retries: int = 2  # per request, after the first attempt (timeouts, 5xx, a connection lost to a live server)
    # requests posted at once, one per sample (SGLang admits them as its KV pool allows and queues
    # the rest); None: as many as the server's KV pool holds at full length (max prompt + max
    # response tokens), so none is retracted for space, and no more than the server's own limit of
    # running requests (bpo_megatron/planner/rollout.py states the rule; plan shows the number)
    max_inflight: int | None = None

    @property
    def server_start_s(self) -> float:
        """How long a started server may take to answer /health: ``startup_timeout_s``, plus
        ``deep_gemm_compile_s`` when it serves FP8."""
        return self.startup_timeout_s + (self.deep_gemm_compile_s if self.quantization == "fp8" else 0.0)

    @property
    def start_bound_s(self) -> float:
        """An engine's whole start: the server's (:attr:`server_start_s`), plus
        ``fp8_copy_timeout_s`` for the block-FP8 copy made before it when it serves FP8."""
        return self.server_start_s + (self.fp8_copy_timeout_s if self.quantization == "fp8" else 0.0)

    def __post_init__(self) -> None:
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError("rollout.sglang.max_inflight must be >= 1 (or null: from the server)")
        for name in ("tp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.sglang.{name} must be >= 1")
        if self.tp_size % self.ep_size:
            raise ValueError(f"rollout.sglang.ep_size={self.ep_size} must divide rollout.sglang.tp_size={self.tp_size} "
                             "(SGLang splits each engine's TP ranks into expert-parallel groups)")
        for name in ("startup_timeout_s", "deep_gemm_compile_s", "fp8_copy_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.sglang.{name} must be > 0 seconds, got {getattr(self, name)}")
        if EP_FLAGS & set(self.extra_args):
            raise ValueError("rollout.sglang.extra_args: the expert-parallel size is set by rollout.sglang.ep_size "
                             f"(remove {sorted(EP_FLAGS & set(self.extra_args))})")
        if self.max_retries < 0:
            raise ValueError("rollout.sglang.max_retries must be >= 0")
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"rollout.sglang.quantization={self.quantization!r}: choose none or fp8")
        if self.quantization != "none" and "--quantization" in self.extra_args:
            raise ValueError("rollout.sglang.extra_args: --quantization is set by rollout.sglang.quantization")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"rollout.sglang.request_timeout_s must be > 0 seconds, or null (no deadline per request: "
                             f"rollout.stall_timeout_s bounds a server that stops making progress), got "
                             f"{self.request_timeout_s}")
        if "--config" in self.extra_args or "--api-key" in self.extra_args:
            raise ValueError("rollout.sglang.extra_args: --config and --api-key are set by the engine (a per-server "
                             "secret passed in a private config file); remove them")


@dataclass(frozen=True)
class SGLangConfig(SGLangOptions):
    """One engine: the options, the checkpoint it serves and whether it captures routed experts."""

    model_path: str = ""
    node_address: str = "127.0.0.1"  # the address other nodes reach the engine's node at
    capture_routed_experts: bool = True
    memory_saver: bool = False  # colocated: the server can release and resume its GPU memory
    visible_devices: tuple[int, ...] = ()  # the GPUs of its placement slots (the server's CUDA_VISIBLE_DEVICES)
    sequence_tokens: int = 0  # the longest sequence a request can reach (prompt + response); 0: unknown
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES  # the most one weight-update call sends (weight_sync.bucket_mb)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_bucket_bytes < 1:
            raise ValueError(f"an SGLang engine's weight buckets hold at least one byte, got {self.weight_bucket_bytes}")
        if not self.url and not self.model_path:
            raise ValueError("an SGLang engine needs model_path (model.path) unless rollout.sglang.url attaches to a server")

    def with_port(self, port: int) -> SGLangConfig:
        return replace(self, port=port)

    @property
    def bind_address(self) -> str:
        return self.host or self.node_address

    @property
    def advertised_address(self) -> str:
        """Where other processes, on any node, reach the server."""
        return self.node_address if self.bind_address in ("0.0.0.0", "::") else self.bind_address

    def launch_command(self, port: int | None = None) -> list[str]:
        """The server command line: token ids in and out, routed experts when capturing."""
        cmd = [*self.launcher, "--model-path", self.model_path, "--host", self.bind_address,
               "--port", str(port or self.port), "--tp-size", str(self.tp_size), "--skip-tokenizer-init"]
        if self.ep_size > 1:
            cmd += ["--ep-size", str(self.ep_size)]
        if self.capture_routed_experts:  # the metrics: its count of retractions for KV space (R3's masking)
            cmd += ["--enable-return-routed-experts", "--enable-metrics"]
        if self.memory_saver:
            cmd.append("--enable-memory-saver")
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.quantization != "none":
            cmd += ["--quantization", self.quantization]
        return cmd + list(self.extra_args)
