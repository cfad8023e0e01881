"""The weight transports as the driver chooses them: every engine's spec names one that exists
for either placement, and colocated engine TP ranks map to the trainer ranks on their GPUs."""

from __future__ import annotations

import pytest

from bpo_megatron.rollout.engine import ENGINES, engine_spec
from bpo_megatron.weight_sync import TRANSPORTS, transport_class
from bpo_megatron.weight_sync.cuda_ipc import colocated_ranks


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("colocated", [False, True])
def test_every_engine_receives_weights_over_a_transport_that_exists(engine, colocated):
    spec = engine_spec(engine)
    name = spec.transport(spec.options(), colocated)
    sender = transport_class(name)
    assert name in TRANSPORTS and sender.__name__ in TRANSPORTS[name]
    # a transport that reaches engines on the trainer's GPUs never moves host tensors into them
    assert not (engine == "sglang" and sender.host_tensors)


def test_sglang_transport_follows_the_placement():
    spec = engine_spec("sglang")
    assert [spec.transport(spec.options(), colocated) for colocated in (False, True)] == ["nccl_broadcast",
                                                                                           "cuda_ipc"]


def test_colocated_engine_tp_ranks_sit_beside_consecutive_trainer_ranks():
    # the 30B-A3B recipe: 8 engines of TP 4 over 32 trainer ranks (bundles e*4 .. e*4+3)
    assert [colocated_ranks(e, 4, 32) for e in (0, 1, 7)] == [(0, 1, 2, 3), (4, 5, 6, 7), (28, 29, 30, 31)]
    with pytest.raises(ValueError, match=r"needs trainer ranks 32–35, the trainer has 32 .*cluster.trainer_ranks"):
        colocated_ranks(8, 4, 32)


def test_an_unknown_transport_names_those_there_are():
    with pytest.raises(ValueError, match=r"no weight transport 'rdma'; there are \['cuda_ipc', 'nccl_broadcast'"):
        transport_class("rdma")
