"""Multi-token-prediction layers (GLM-4.5's and DeepSeek-V3's ``num_nextn_predict_layers``) are carried
beside the model (:mod:`bpo_megatron.weights.mtp`): a Hugging Face → trainer checkpoint → Hugging Face
round trip returns every tensor bit for bit, MTP layers included; a trainer's saves carry them on
(linked from the checkpoint it loaded, or read from the Hugging Face directory it loaded), a weight
sync sends the main model only, and the trainer's log-probs are those of the model without them.
Random tiny models: the main model and each MTP layer's decoder layer made by transformers."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bpo_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
from bpo_megatron.loop.preflight import check_pretrained_weights
from bpo_megatron.loop.run_dir import RunRefused
from bpo_megatron.models import HFModelConfig
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing.models import deepseek_v3_config, glm4_moe_config, random_checkpoint_with_mtp, write_config
from bpo_megatron.weights import mtp
from bpo_megatron.weights.names import hf_tensor_shapes
from bpo_megatron.weights.safetensors_io import INDEX_FILE, HFWeightsReader

TIMEOUT = 300
# family -> (config maker, whether its MTP layer repeats the embedding and output head, as DeepSeek-V3's does)
FAMILIES = {"glm4_moe": (glm4_moe_config, False), "deepseek_v3": (deepseek_v3_config, True)}


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_models")
    return {family: random_checkpoint_with_mtp(make(num_nextn_predict_layers=1), root / family, seed=11,
                                               repeat_head=repeat)
            for family, (make, repeat) in FAMILIES.items()}


def _main_only(hf_dir: Path, out: Path) -> Path:
    """The main model of ``hf_dir`` alone (its first shard), its config counting no MTP layer."""
    config = json.loads((hf_dir / "config.json").read_text())
    write_config({**config, "num_nextn_predict_layers": 0}, out)
    shutil.copy(hf_dir / "model-00001-of-00002.safetensors", out / "model.safetensors")
    return out


def _assert_bit_exact(exported: Path, original: Path) -> None:
    """The same tensor names, and each tensor's dtype, shape and bytes equal."""
    with HFWeightsReader(exported) as ours, HFWeightsReader(original) as theirs:
        assert sorted(ours.weight_map) == sorted(theirs.weight_map)
        for name in theirs.weight_map:
            a, b = ours.slice(name)[:], theirs.slice(name)[:]
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), name


def _mtp_names(hf_dir: Path) -> list[str]:
    weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
    return sorted(name for name, file in weight_map.items() if file == "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("family, layout", [("glm4_moe", {"tp": 2}), ("deepseek_v3", {"ep": 2})])
def test_a_round_trip_returns_every_tensor_bit_exact_mtp_layers_included(mtp_models, family, layout, tmp_path):
    hf_dir = mtp_models[family]
    hf = HFModelConfig.load(hf_dir)
    names = _mtp_names(hf_dir)
    # the MTP layer: a whole MoE decoder layer (layer 3, past the 3 main layers) and its own tensors
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in names and "model.layers.3.eh_proj.weight" in names
    assert ("model.layers.3.shared_head.head.weight" in names) == (family == "deepseek_v3")
    assert not any(name.startswith("model.layers.3.") for name in hf_tensor_shapes(hf))

    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(**layout), progress=False,
                               timeout=TIMEOUT)
    step = ckpt / "step-00000000"
    carried = mtp.carried_in(step)
    assert carried is not None and carried.layers == 1 and sorted(carried.names) == names
    checksums = json.loads((step / "checksums.json").read_text())
    assert "mtp/model-00001-of-00001.safetensors" in checksums  # verified like the model's files
    assert json.loads((step / "trainer_state.json").read_text())["hf_config"]["num_nextn_predict_layers"] == 1

    out = convert_mcore_to_hf(ckpt, tmp_path / "hf", progress=False, timeout=TIMEOUT)  # resharded to one rank
    _assert_bit_exact(out, hf_dir)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def _trainer_saves(hf_dir: str, main_dir: str, converted: str, roots: list[str]) -> dict:
    """A trainer that loads the converted checkpoint saves twice (blocking, then in the background),
    another loads the Hugging Face directory and saves once; what a weight sync sends and the
    log-probs with and without the MTP layers in the directory loaded."""
    from bpo_megatron import testing as th

    hf = HFModelConfig.load(hf_dir)
    samples = th.make_samples(4, seed=3, hf=hf)
    actor = th.build_actor(hf)
    actor.load(converted)
    actor.save(roots[0], step=1)
    actor.save(roots[0], step=2, background=True)
    actor.finish_saves()
    sent = [name for bucket in actor.export_weights(1 << 20) for name, _ in bucket]
    actor.load_hf(hf_dir)
    with_mtp = actor.compute_logprobs(samples).logprobs
    actor.save(roots[1], step=5)
    actor.load_hf(main_dir)
    without_mtp = actor.compute_logprobs(samples).logprobs
    actor.close()
    return {"sent": sent, "logprobs": (with_mtp, without_mtp)}


def test_trainer_checkpoints_carry_the_mtp_layers_and_a_weight_sync_leaves_them_out(mtp_models, tmp_path):
    hf_dir = mtp_models["deepseek_v3"]
    hf = HFModelConfig.load(hf_dir)
    main_dir = _main_only(hf_dir, tmp_path / "main_only")
    converted = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", progress=False, timeout=TIMEOUT)
    roots = [str(tmp_path / "run"), str(tmp_path / "run_from_hf")]
    result, = run_gloo_world(_trainer_saves, 1, str(hf_dir), str(main_dir), str(converted), roots, timeout=TIMEOUT)

    # the weight sync sends the main model's tensors, no MTP tensor (engines keep the ones they started with)
    assert result["sent"] == list(hf_tensor_shapes(hf))
    # the MTP layers take no part in the trainer's computation
    with_mtp, without_mtp = result["logprobs"]
    assert all(torch.equal(a, b) for a, b in zip(with_mtp, without_mtp, strict=True))

    shard = "mtp/model-00001-of-00001.safetensors"
    source = os.stat(converted / "step-00000000" / shard)
    for step in ("step-00000001", "step-00000002"):  # linked from the checkpoint loaded, then from the last saved
        saved = Path(roots[0]) / step
        assert os.stat(saved / shard).st_ino == source.st_ino
        assert shard in json.loads((saved / "checksums.json").read_text())
    # read from the Hugging Face directory the trainer loaded
    assert mtp.carried_in(Path(roots[1]) / "step-00000005").layers == 1
    for root in roots:
        state = json.loads((Path(root) / "latest").parent.joinpath(
            (Path(root) / "latest").read_text().strip(), "trainer_state.json").read_text())
        assert state["hf_config"]["num_nextn_predict_layers"] == 1
        out = convert_mcore_to_hf(root, tmp_path / f"export_{Path(root).name}", progress=False, timeout=TIMEOUT)
        _assert_bit_exact(out, hf_dir)


def _with_tensors(hf_dir: Path, out: Path, *, drop: str = "", rename: tuple[str, str] = ("", ""),
                  count: int = 1) -> Path:
    """A copy of ``hf_dir`` whose MTP shard lacks ``drop`` or has ``rename[0]`` renamed to ``rename[1]``,
    its config counting ``count`` MTP layers."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out)
    shard = out / "model-00002-of-00002.safetensors"
    tensors = {name.replace(*rename) if rename[0] else name: t for name, t in load_file(str(shard)).items()
               if name != drop}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((out / INDEX_FILE).read_text())
    index["weight_map"] = {**{n: f for n, f in index["weight_map"].items() if f != shard.name},
                           **dict.fromkeys(tensors, shard.name)}
    (out / INDEX_FILE).write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    write_config({**config, "num_nextn_predict_layers": count}, out)
    return out


def test_an_incomplete_or_uncounted_mtp_layer_is_refused_before_anything_is_written(mtp_models, tmp_path):
    hf_dir = mtp_models["glm4_moe"]
    cases = {
        "no_hnorm": (dict(drop="model.layers.3.hnorm.weight"),
                     ["multi-token-prediction layer 3", "model.layers.3.hnorm.weight", "is missing"]),
        "no_expert": (dict(drop="model.layers.3.mlp.experts.5.up_proj.weight"),
                      ["model.layers.3.mlp.experts.5.up_proj.weight"]),
        "uncounted": (dict(count=0), ["layers [3]", "num_nextn_predict_layers=0"]),
        "a_second_layer": (dict(rename=("model.layers.3.enorm", "model.layers.4.enorm")),
                           ["layers [3, 4]", "num_nextn_predict_layers=1"]),
    }
    for case, (change, needles) in cases.items():
        broken = _with_tensors(hf_dir, tmp_path / case, **change)
        with pytest.raises(ValueError) as refused:
            convert_hf_to_mcore(broken, tmp_path / f"ckpt_{case}", progress=False, timeout=TIMEOUT)
        for needle in needles:
            assert needle in str(refused.value), (case, str(refused.value))
        assert not (tmp_path / f"ckpt_{case}").exists()
        # a run starting from these weights is refused by its preflight, before Ray or any model starts
        with pytest.raises(RunRefused, match=f"(?s)model.path={re.escape(str(broken))}: .*{re.escape(needles[-1])}"):
            check_pretrained_weights(SimpleNamespace(model=SimpleNamespace(path=str(broken))), HFModelConfig.load(broken))


def test_a_config_counting_mtp_layers_the_weights_lack_is_said_and_written_as_none(mtp_models, tmp_path):
    """config.json counts one MTP layer, the weights hold none: the conversion says so, and the
    checkpoint's config (and so any export of it) counts none."""
    hf_dir = _main_only(mtp_models["glm4_moe"], tmp_path / "main_only")
    write_config({**json.loads((hf_dir / "config.json").read_text()), "num_nextn_predict_layers": 1}, hf_dir)
    with pytest.warns(UserWarning, match=r"num_nextn_predict_layers=1 .* holds 0"):
        ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", progress=False, timeout=TIMEOUT)
    state = json.loads((ckpt / "step-00000000" / "trainer_state.json").read_text())
    assert state["hf_config"]["num_nextn_predict_layers"] == 0
    assert mtp.carried_in(ckpt / "step-00000000") is None
