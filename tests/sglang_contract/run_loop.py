"""``python run_loop.py RUN_DIR OVERRIDE...``: the RL loop of the CPU demo over SGLang stand-in
servers, in a Ray of its own whose worker processes run :mod:`standin_hooks` first. Prints the
loop's result as one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


NODES_FLAG = "--nodes"  # --nodes A_CPUS,B_CPUS,...: Ray nodes of this machine at 127.0.0.2, 127.0.0.3, ...


def main(argv: list[str]) -> int:
    import ray

    nodes = None
    if argv and argv[0] == NODES_FLAG:
        nodes, argv = [int(n) for n in argv[1].split(",")], argv[2:]
    run_dir, overrides = argv[0], argv[1:]
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"worker_process_setup_hook": "standin_hooks.inline_ipc", "env_vars": {"PYTHONPATH": path}}
    cluster = None
    if nodes is None:
        ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=384 * 2**20, logging_level="ERROR", runtime_env=runtime_env)
    else:  # Ray packs the bundles into the nodes in order: a node's CPUs decide what lands there
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": nodes[0], "node_ip_address": "127.0.0.2", "include_dashboard": False,
            "object_store_memory": 256 * 2**20})
        for i, cpus in enumerate(nodes[1:], start=3):
            cluster.add_node(num_cpus=cpus, node_ip_address=f"127.0.0.{i}", object_store_memory=256 * 2**20)
        ray.init(address=cluster.address, logging_level="ERROR", runtime_env=runtime_env)
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop.rl_loop import run

    cfg = load_experiment(ROOT / "configs" / "tiny_moe_cpu.yaml", [*overrides, f"logging.run_dir={run_dir}"])
    result = run(cfg)
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
