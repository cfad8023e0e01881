"""Where the trainer ranks and the rollout engines run: one bundle per GPU, engines on the
trainer's GPUs (colocated) or on their own, bundles in (node, GPU) order.

The layouts are those of the 30B-A3B recipe on 4 nodes × 8 GPUs. The Ray part runs a local Ray
cluster of 4 nodes that *declare* 8 GPUs each (no GPU is touched: the actors report the node and
GPU ids Ray assigned them), in a subprocess so that it does not meet the session's Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bpo_megatron.orchestration.config import ClusterConfig
from bpo_megatron.orchestration.placement import PlacementError, plan_layout

ROOT = Path(__file__).resolve().parents[1]
RECIPE = dict(trainer_ranks=32, gpus_per_trainer_rank=1, gpus_per_engine=4, nodes=4, gpus_per_node=8)


def test_colocated_recipe_puts_eight_tp4_engines_on_the_trainers_gpus():
    plan = plan_layout(ClusterConfig(**RECIPE, colocate=True), num_engines=8)
    assert len(plan.bundles) == 32 and plan.gpus == 32
    assert [s.bundle for s in plan.trainer] == list(range(32)) and {s.num_gpus for s in plan.trainer} == {0.5}
    assert plan.engine_bundles == tuple(tuple(range(4 * i, 4 * i + 4)) for i in range(8))
    assert [s.bundle for s in plan.engines] == [0, 4, 8, 12, 16, 20, 24, 28] and {s.num_gpus for s in plan.engines} == {0.5}
    # bundles alike (Ray packs greedily by size); the actors sharing one split its CPUs too
    assert set(map(str, plan.bundles)) == {str({"CPU": 1.0, "GPU": 1.0})}
    assert {s.num_cpus for s in (*plan.trainer, *plan.engines)} == {0.5}


def test_disaggregated_layout_gives_the_engines_their_own_gpus():
    plan = plan_layout(ClusterConfig(**{**RECIPE, "trainer_ranks": 24}, colocate=False), num_engines=2)
    assert len(plan.bundles) == 32 and {s.num_gpus for s in (*plan.trainer, *plan.engines)} == {1.0}
    assert plan.engine_bundles == ((24, 25, 26, 27), (28, 29, 30, 31))
    assert plan.engines[1].num_cpus == 1.0 and plan.bundles[25] == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize("fields, engines, match", [
    (dict(colocate=True), 9, r"9 × 4 = 36 devices but the trainer has 32 .*rollout.num_engines × cluster.gpus_per_engine"),
    (dict(gpus_per_trainer_rank=0.5), 8, "cluster.gpus_per_trainer_rank=0.5"),
    (dict(gpus_per_engine=1.5), 8, "cluster.gpus_per_engine=1.5"),
])
def test_layouts_that_cannot_be_made_are_refused_naming_the_fields(fields, engines, match):
    with pytest.raises(PlacementError, match=match):
        plan_layout(ClusterConfig(**{**RECIPE, **fields}), num_engines=engines)


RAY_SCRIPT = r"""
import json, sys, time
import ray
from ray.cluster_utils import Cluster
from bpo_megatron.orchestration.config import ClusterConfig
from bpo_megatron.orchestration.placement import Placement, PlacementError, plan_layout

cluster = Cluster()
for _ in range(4):
    cluster.add_node(num_cpus=8, num_gpus=8, object_store_memory=80 * 2**20)
cluster.wait_for_nodes()
ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)


@ray.remote
class Probe:
    def where(self):
        return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


def layout(colocate, ranks, engines):
    cfg = ClusterConfig(trainer_ranks=ranks, gpus_per_trainer_rank=1, gpus_per_engine=4, colocate=colocate,
                        placement_timeout_s=60)
    placement = Placement(plan_layout(cfg, num_engines=engines), timeout_s=60)
    trainer = [Probe.options(**placement.trainer_options(r)).remote() for r in range(ranks)]
    engine = [Probe.options(**placement.engine_options(i)).remote() for i in range(engines)]
    out = {"trainer": ray.get([p.where.remote() for p in trainer]),
           "engines": ray.get([p.where.remote() for p in engine]),
           "engine_gpus": [list(placement.engine_gpus(i)) for i in range(engines)]}
    for p in trainer + engine:
        ray.kill(p)
    placement.remove()
    return out


result = {"colocated": layout(True, 32, 8), "apart": layout(False, 24, 2)}
start = time.monotonic()
try:
    Placement(plan_layout(ClusterConfig(trainer_ranks=33, gpus_per_trainer_rank=1), num_engines=0), timeout_s=60)
    result["impossible"] = None
except PlacementError as error:
    result["impossible"] = str(error)
result["impossible_s"] = time.monotonic() - start
print("RESULT " + json.dumps(result))
ray.shutdown()
cluster.shutdown()
"""


@pytest.fixture(scope="module")
def ray_layouts():
    done = subprocess.run([sys.executable, "-c", RAY_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.ci  # a 4-node Ray cluster (CI time): the plans it places are checked in the default run above
@pytest.mark.timeout(450)
def test_ray_places_the_colocated_recipe_on_four_nodes_of_eight_declared_gpus(ray_layouts):
    got = ray_layouts["colocated"]
    trainer = [(node, gpus[0]) for node, gpus in got["trainer"]]
    nodes = list(dict.fromkeys(node for node, _ in trainer))
    assert len(nodes) == 4
    # ranks in (node, GPU) order: 8 consecutive ranks per node, GPUs 0..7 in rank order
    assert [node for node, _ in trainer] == [n for n in nodes for _ in range(8)]
    assert [gpu for _, gpu in trainer] == list(range(8)) * 4
    # each TP4 engine's actor shares the GPU of trainer rank 4i; its server uses that GPU and the next 3
    for i, (node, gpus) in enumerate(got["engines"]):
        assert (node, gpus[0]) == trainer[4 * i]
        assert got["engine_gpus"][i] == [trainer[4 * i + k][1] for k in range(4)]
        assert {trainer[4 * i + k][0] for k in range(4)} == {node}


@pytest.mark.ci  # the same 4-node Ray cluster: the refusal's arithmetic is checked in the default run above
@pytest.mark.timeout(450)
def test_ray_places_disaggregated_engines_apart_and_refuses_the_impossible_at_once(ray_layouts):
    got = ray_layouts["apart"]
    trainer = {(node, gpus[0]) for node, gpus in got["trainer"]}
    engine_devices = {(got["engines"][i][0], gpu) for i in range(2) for gpu in got["engine_gpus"][i]}
    assert len(trainer) == 24 and len(engine_devices) == 8 and not trainer & engine_devices
    assert ray_layouts["impossible_s"] < 60
    assert "33 GPUs, the cluster has 32" in ray_layouts["impossible"], ray_layouts["impossible"]
    assert "cluster.trainer_ranks" in ray_layouts["impossible"] and "cluster.gpus_per_engine" in ray_layouts["impossible"]


def test_ranks_follow_node_then_gpu_whatever_order_ray_placed_the_bundles():
    """A fake 2-node placement (8 GPUs each) whose bundles Ray handed out interleaved across the
    nodes with GPU ids shuffled: logical slots (= trainer ranks) still run through node A's GPUs
    0–7, then node B's, so every TP4 group lies inside one node on consecutive GPUs."""
    import random

    from bpo_megatron.orchestration.placement import logical_order

    shuffled = [("node-A", [gpu]) for gpu in range(8)] + [("node-B", [gpu]) for gpu in range(8)]
    random.Random(0).shuffle(shuffled)
    shuffled.insert(0, shuffled.pop(next(i for i, (node, _) in enumerate(shuffled) if node == "node-A")))
    order = logical_order(shuffled)
    ranks = [shuffled[b] for b in order]
    assert ranks == [("node-A", [g]) for g in range(8)] + [("node-B", [g]) for g in range(8)]
    for first in range(0, 16, 4):  # tp = 4
        assert len({node for node, _ in ranks[first:first + 4]}) == 1
    # bundles without GPUs (a CPU cluster) keep their index order within a node
    assert logical_order([("b", []), ("a", []), ("b", [])]) == [0, 2, 1]
