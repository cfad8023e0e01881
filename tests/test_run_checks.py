"""What a run reads is checked before anything starts, and a run directory stays the record of
one run: bad data, configs and checkpoints are refused by the CLI with exit status 2 and a
message naming the file, line or setting, before Ray or a model starts and before anything is
written; re-runs with other settings, a changed model, a second driver and damaged checkpoints
are refused; a missing ``latest`` never means a fresh start; metrics hold each step once."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bpo_megatron import testing as th
from bpo_megatron.cli import main
from bpo_megatron.experiment import load_experiment
from bpo_megatron.loop.preflight import prepare
from bpo_megatron.loop.run_dir import RunLock, RunRefused, record_config
from bpo_megatron.observability.metrics import MetricsWriter, read_metrics
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer import checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")
DEMO_MODEL = ROOT / "configs" / "models" / "tiny_qwen3_moe"


def _records(path: Path, *records: dict | str) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _ok(i: int) -> dict:
    return {"id": f"q{i}", "problem": f"{i}+1", "answer": str(i + 1)}


def _train(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", DEMO, *args])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


# --------------------------------------------------------------------------- refused input
BAD_INPUT = {
    "missing data file": (lambda d: ["data.train=" + str(d / "nowhere.jsonl")],
                          r"data.train=.*nowhere.jsonl.*neither a known name"),
    "empty data file": (lambda d: ["data.train=" + str(_records(d / "empty.jsonl", ""))],
                        r"empty.jsonl holds no problems"),
    "malformed line": (lambda d: ["data.train=" + str(_records(d / "bad.jsonl", _ok(0), "{oops"))],
                       r"bad.jsonl:2: not valid JSON"),
    "record without a mapped field": (
        lambda d: ["data.train=" + str(_records(d / "bad.jsonl", _ok(0), {"id": "q1", "problem": "1+1"}))],
        r"bad.jsonl:2: field 'answer' must be a non-empty string"),
    "unknown procedural task": (lambda d: ["data.train=procedural:mul"],
                                r"data.train='procedural:mul': procedural task 'mul' is unknown; choose one of"),
    "missing evaluation set": (lambda d: ["eval.datasets=[" + str(d / "gone.jsonl") + "]"],
                               r"eval.datasets\[0\]=.*gone.jsonl.*neither a known name"),
    "prompt over data.max_prompt_tokens": (
        lambda d: ["data.train=" + str(_records(d / "long.jsonl", _ok(0), {"id": "long", "problem": "1" * 40,
                                                                         "answer": "2"}))],
        r"long.jsonl:2: \(id 'long'\) prompt of 41 tokens exceeds data.max_prompt_tokens=16.*data.on_bad_record=skip"),
    "character the tokenizer lacks": (
        lambda d: ["data.train=" + str(_records(d / "odd.jsonl", {"id": "é", "problem": "2é1", "answer": "3"}))],
        r"odd.jsonl:1: \(id 'é'\) character 'é' is not in the character tokenizer"),
    "reference answer the tokenizer lacks (warm start)": (
        lambda d: ["data.train=" + str(_records(d / "odd.jsonl", {"id": "a", "problem": "2+1", "answer": "∞"}))],
        r"odd.jsonl:1: \(id 'a'\) character '∞' is not in the character tokenizer"),
    "reference answer over the response budget (warm start)": (
        lambda d: ["data.train=" + str(_records(d / "long.jsonl", _ok(0), {"id": "wordy", "problem": "2+1",
                                                                         "answer": "3" * 20}))],
        r"long.jsonl:2: \(id 'wordy'\) reference answer of 21 tokens \(with end-of-sequence\) exceeds "
        r"rollout.max_new_tokens=4, the response budget the warm start \(train.sft_warmup_steps\) trains within"),
    "BPO cap below 1": (lambda d: ["loss.bpo_cap=0.5"], r"bpo_cap must be >= 1"),
    "budget beyond the model's positions": (
        lambda d: ["rollout.max_new_tokens=120"],
        r"data.max_prompt_tokens=16 \+ rollout.max_new_tokens=120 = 136 tokens exceed the model's "
        r"max_position_embeddings=128"),
    "tokenizer larger than the vocabulary": (
        lambda d: ["model.tokenizer=" + str(_tokenizer_dir(d))],
        r"the tokenizer .* has \d+ tokens but the model's vocabulary .* has 128"),
}


def _tokenizer_dir(directory: Path) -> Path:
    """A Hugging Face tokenizer of 300 tokens (a word-level one, written offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(299)} | {"<unk>": 299}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    out = directory / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="w1").save_pretrained(out)
    return out


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_before_anything_starts(case, tmp_path, capsys):
    overrides, message = BAD_INPUT[case]
    run_dir = tmp_path / "run"
    code, output = _train(capsys, *overrides(tmp_path), f"logging.run_dir={run_dir}")
    assert code == 2, output
    assert len([line for line in output.splitlines() if line.startswith("bpo-megatron train:")]) == 1
    assert re.search(message, output, re.S), output
    assert not run_dir.exists(), "nothing may be written for a refused run"


def test_bad_records_can_be_skipped_and_are_counted(tmp_path, capsys):
    data = _records(tmp_path / "mixed.jsonl", _ok(0), "{oops", {"id": "long", "problem": "1" * 40, "answer": "2"},
                    _ok(3), {"id": "q1", "problem": "1+1"}, _ok(5))
    run_dir = tmp_path / "run"
    code, output = _train(capsys, f"data.train={data}", "data.on_bad_record=skip", f"logging.run_dir={run_dir}",
                          "--check")
    assert code == 0, output
    assert "training prompts: 3 problems of" in output and "3 left out" in output
    assert "note: data.on_bad_record=skip: 3 training records left out (first: " in output
    assert not run_dir.exists(), "--check writes nothing"
    cfg = load_experiment(DEMO, [f"data.train={data}", "data.on_bad_record=skip", f"logging.run_dir={run_dir}"])
    plan = prepare(cfg)
    drawn = {e.problem.id for e in plan.prompts.take(300)}  # many epochs of the 3 good records
    assert drawn == {"q0", "q3", "q5"}
    assert sorted(str(r).split(": ", 1)[0] for r in plan.prompts.rejected) == [f"{data}:2", f"{data}:3", f"{data}:5"]


def test_settings_of_an_engine_the_run_does_not_use_are_named_by_check(tmp_path, capsys):
    """FP8 serving set in SGLang's section of a run on the embedded engine did nothing without a
    word: --check (and the run's start, which echoes the same notes) names every such setting,
    the chosen engine's own setting of that name, and the fix; a run without them has no note."""
    run_dir = tmp_path / "run"
    code, output = _train(capsys, "rollout.sglang.quantization=fp8", "rollout.sglang.tp_size=2",
                          f"logging.run_dir={run_dir}", "--check")
    assert code == 0, output
    assert ("note: rollout.engine=hf: the sections of the other engines are not used, so these settings do nothing: "
            "rollout.sglang.tp_size=2; rollout.sglang.quantization='fp8' (this engine's own is rollout.hf.quantization); "
            "move them to rollout.hf or drop them") in output
    code, output = _train(capsys, f"logging.run_dir={run_dir}", "--check")
    assert code == 0 and "sections of the other engines" not in output, output
    assert not run_dir.exists()


def test_eval_without_a_checkpoint_is_refused(tmp_path, capsys):
    assert main(["eval", DEMO, f"logging.run_dir={tmp_path / 'run'}"]) == 2
    assert "the run has no checkpoint yet" in capsys.readouterr().err
    assert main(["eval", DEMO, "--checkpoint", str(tmp_path)]) == 2
    assert f"--checkpoint {tmp_path}: no checkpoint there" in capsys.readouterr().err


# ---------------------------------------------------------------- a run directory with checkpoints
def _save_checkpoints(root: str, steps: list[int]) -> None:
    """Real trainer checkpoints of the demo model, as the loop writes them."""
    actor = th.build_actor(DEMO_MODEL)
    for step in steps:
        actor.save(root, step=step, keep_last=None,
                   trainer_state={"rl_step": step, "data_cursor": 16 * step, "sft_done": True})
    actor.close()


def _load_checkpoint(root: str) -> None:
    actor = th.build_actor(DEMO_MODEL)
    try:
        actor.load(root)
    finally:
        actor.close()


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved") / "checkpoints"
    run_gloo_world(_save_checkpoints, 1, str(root), [1, 2, 3], timeout=120)
    return root


@pytest.fixture
def run_dir(tmp_path, saved_checkpoints) -> Path:
    """A run directory as an interrupted demo run leaves it: config, metrics, checkpoints 1–3."""
    run_dir = tmp_path / "run"
    cfg = load_experiment(DEMO, [f"logging.run_dir={run_dir}"])
    record_config(cfg, run_dir)
    shutil.copytree(saved_checkpoints, run_dir / "checkpoints")
    writer = MetricsWriter(run_dir, tensorboard=False)
    for step in range(-2, 5):
        writer.write(step, {"reward_mean": step / 10})
    writer.close()
    return run_dir


def _demo(run_dir: Path, *overrides: str):
    return load_experiment(DEMO, [f"logging.run_dir={run_dir}", *overrides])


def test_a_rerun_with_other_settings_is_refused_naming_them(run_dir, capsys):
    code, output = _train(capsys, f"logging.run_dir={run_dir}", "loss.name=grpo", "optimizer.lr=0.1")
    assert code == 2
    assert "loss.name: 'bpo' -> 'grpo'" in output and "optimizer.lr: 0.0003 -> 0.1" in output
    assert "--override-resume loss.name,optimizer.lr" in output
    before = (run_dir / "config.yaml").read_text()
    # named, the changes are accepted (and recorded when the run starts)
    plan = prepare(_demo(run_dir, "loss.name=grpo", "optimizer.lr=0.1"), override_resume=("loss.name", "optimizer.lr"))
    assert plan.changes == {"loss.name": ("bpo", "grpo"), "optimizer.lr": (0.0003, 0.1)}
    assert plan.state.step == 3 and plan.checkpoint == str(run_dir / "checkpoints")
    # how the run is computed may change: layout, length, logging
    plan = prepare(_demo(run_dir, "train.steps=500", "parallel.tp=2", "parallel.ep=1", "logging.progress=false"))
    assert plan.changes == {} and plan.state.step == 3
    assert (run_dir / "config.yaml").read_text() == before, "a check writes nothing"


def test_settings_added_since_a_run_was_recorded_resume_at_their_defaults(run_dir, capsys):
    """A run recorded before a setting existed (here: loss.correction, train.dynamic_sampling,
    data.truncated_reward, eval.template) resumes while the setting keeps its default, and is
    refused, naming it, when the setting is given another value."""
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    for section, key in (("loss", "correction"), ("train", "dynamic_sampling"), ("data", "truncated_reward"),
                         ("eval", "template")):
        recorded[section].pop(key)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(recorded))
    plan = prepare(_demo(run_dir))
    assert plan.changes == {} and plan.state.step == 3
    code, output = _train(capsys, f"logging.run_dir={run_dir}", "train.dynamic_sampling=true")
    assert code == 2 and "train.dynamic_sampling: None -> True" in output


def test_a_run_recorded_with_keys_that_moved_since_resumes_under_their_new_homes(run_dir, capsys):
    """A run recorded before settings moved to their owners' sections (train.micro_batch_size,
    train.seed, rollout.weight_bucket_mb, the correction as a plain value and its bounds beside it)
    is the same run under the new keys, and a changed value is named at its new key."""
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    trainer, sync, loss = recorded.pop("trainer"), recorded.pop("weight_sync"), recorded["loss"]
    recorded["train"].update(micro_batch_size=trainer["micro_batch_size"], seed=recorded.pop("seed"),
                             max_tokens_per_micro_batch=trainer["max_tokens_per_micro_batch"],
                             verify_weight_sync=sync["verify"])
    recorded["rollout"]["weight_bucket_mb"] = sync["bucket_mb"]
    correction = loss.pop("correction")
    loss.update(correction=correction["name"], **{k: v for k, v in correction.items() if k != "name"})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(recorded))
    plan = prepare(_demo(run_dir))
    assert plan.changes == {} and plan.state.step == 3
    code, output = _train(capsys, f"logging.run_dir={run_dir}", "seed=7", "loss.correction.tis_cap=3")
    assert code == 2 and "seed: 1234 -> 7" in output and "loss.correction.tis_cap: 2.0 -> 3.0" in output


def test_a_run_recorded_with_a_decode_loop_since_removed_resumes(run_dir):
    """rollout.hf.decode=transformers or static named loops the embedded engine no longer has: a
    run recorded with either resumes (the loop changes how tokens are computed, not which: the
    setting is resume-safe); a config that writes them is refused (tests/test_experiment_config.py)."""
    for removed in ("transformers", "static"):
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
        recorded["rollout"]["hf"]["decode"] = removed
        (run_dir / "config.yaml").write_text(yaml.safe_dump(recorded))
        plan = prepare(_demo(run_dir))
        assert plan.changes == {} and plan.state.step == 3


def test_a_changed_model_config_is_refused_naming_the_fields(run_dir, tmp_path):
    changed = tmp_path / "model"
    changed.mkdir()
    raw = json.loads((DEMO_MODEL / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**raw, "rope_theta": 1e6, "rms_norm_eps": 1e-5}))
    cfg = _demo(run_dir, f"model.path={changed}")
    with pytest.raises(RunRefused, match=r"(?s)differs from the one .*step-00000003 was trained with:\n"
                                         r"  rms_norm_eps: 1e-06 -> 1e-05\n  rope_theta: 10000.0 -> 1000000.0"):
        prepare(cfg, override_resume=("model.path",))
    # the random initial weights the engines start from are checked too (no checkpoint yet)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "initial_hf").mkdir()
    (run_dir / "initial_hf" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(RunRefused, match=r"differs from the run's initial weights"):
        prepare(cfg, override_resume=("model.path",))


def test_resume_false_on_a_run_directory_is_refused(run_dir, capsys):
    code, output = _train(capsys, f"logging.run_dir={run_dir}", "checkpoint.resume=false")
    assert code == 2 and "already holds a run and checkpoint.resume=false would mix a new run into it" in output


def test_a_second_driver_is_refused_and_a_dead_ones_lock_taken_over(run_dir):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from bpo_megatron.loop.run_dir import RunLock\n"
         f"with RunLock(Path({str(run_dir)!r})):\n    print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunRefused, match=rf"in use by another driver \(pid {holder.pid} on host "
                                             rf"{socket.gethostname()}, since "):
            prepare(_demo(run_dir))
        with pytest.raises(RunRefused, match="in use by another driver"):
            RunLock(run_dir).__enter__()
    finally:
        holder.kill()  # as kill -9 would: the lock file stays behind
        holder.wait(timeout=30)
    assert (run_dir / ".lock").exists()
    prepare(_demo(run_dir))  # the owner is gone: not refused
    with RunLock(run_dir):
        assert json.loads((run_dir / ".lock").read_text())["pid"] == __import__("os").getpid()
    assert not (run_dir / ".lock").exists()


@pytest.mark.parametrize("marker", ["missing", "dangling", "stale"])
def test_latest_only_names_a_checkpoint_the_newest_is_used(run_dir, marker):
    root = run_dir / "checkpoints"
    if marker == "missing":
        (root / "latest").unlink()
    elif marker == "dangling":
        (root / "latest").write_text("step-00000009")
    else:  # killed between the rename of step 3 and the marker
        (root / "latest").write_text("step-00000002")
    (root / ".partial-step-00000004").mkdir()  # a save in progress is never a checkpoint
    plan = prepare(_demo(run_dir))
    assert plan.state.step == 3 and plan.state.data_cursor == 48
    expected = {"missing": "latest is missing; the newest checkpoint, step-00000003, is used",
                "dangling": "latest names 'step-00000009' but the newest checkpoint is step-00000003, which is used",
                "stale": "latest names 'step-00000002' but the newest checkpoint is step-00000003, which is used"}
    assert [note.split("checkpoints/", 1)[1] for note in plan.notes] == [expected[marker]]


def test_metrics_keep_each_step_once_and_survive_a_torn_line(run_dir):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # a driver killed while writing
    with pytest.warns(UserWarning, match=r"metrics.jsonl:8: the last record is incomplete"):
        assert [r["step"] for r in read_metrics(run_dir)] == [-2, -1, 0, 1, 2, 3, 4]
    writer = MetricsWriter(run_dir, tensorboard=False, resume_after=3)  # resuming from step 3
    writer.write(4, {"reward_mean": 0.9})
    writer.close()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [-2, -1, 0, 1, 2, 3, 4] and records[-1]["reward_mean"] == 0.9
    MetricsWriter(run_dir, tensorboard=False).close()  # a fresh start keeps nothing of an earlier attempt
    assert read_metrics(run_dir) == []
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{broken\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        read_metrics(run_dir)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_named_and_the_previous_one_offered(run_dir, capsys):
    step3 = run_dir / "checkpoints" / "step-00000003"
    shard = max((p for p in step3.rglob("*") if p.is_file() and p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    _flip_a_byte(shard)
    code, output = _train(capsys, f"logging.run_dir={run_dir}")
    assert code == 2
    assert f"{shard} does not match its checksum" in output
    assert "the checkpoint before it, step-00000002, is intact: move step-00000003 aside" in output
    # so does an export to Hugging Face format, before any process starts
    assert main(["convert", "mcore-to-hf", "--ckpt", str(run_dir / "checkpoints"), "--out", str(run_dir / "hf")]) == 2
    assert f"{shard} does not match its checksum" in capsys.readouterr().err and not (run_dir / "hf").exists()
    # the trainer refuses it too, whoever loads it
    with pytest.raises(Exception, match=r"does not match its checksum"):
        run_gloo_world(_load_checkpoint, 1, str(run_dir / "checkpoints"), timeout=120)
    # a torn trainer state is named the same way; once moved aside, step 2 is resumed
    (run_dir / "checkpoints" / "step-00000002" / checkpoint.STATE_FILE).write_text('{"step": 2, "rl_')
    with pytest.raises(RunRefused, match=r"(?s)step-00000003 is damaged.*the checkpoint before it, step-00000001, "
                                         r"is intact"):
        prepare(_demo(run_dir))
    step3.rename(run_dir / "checkpoints" / "damaged-step-00000003")
    with pytest.raises(RunRefused, match=r"trainer_state.json is damaged"):
        prepare(_demo(run_dir))


def test_checksums_cover_every_file_of_a_checkpoint(saved_checkpoints):
    step = saved_checkpoints / "step-00000001"
    manifest = json.loads((step / "checksums.json").read_text())
    files = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "checksums.json")
    assert sorted(manifest) == files and checkpoint.STATE_FILE in manifest
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in manifest.values())
    assert checkpoint.select(saved_checkpoints).path.name == "step-00000003"



def test_a_truncated_safetensors_shard_is_named(tmp_path, capsys):
    from bpo_megatron.testing.models import random_checkpoint

    hf_dir = random_checkpoint(DEMO_MODEL, tmp_path / "hf", seed=0)
    shard = hf_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "ckpt")]) == 2
    assert f"{shard} is not a complete safetensors file" in capsys.readouterr().err
    code, output = _train(capsys, f"model.path={hf_dir}", "model.init=pretrained", f"logging.run_dir={tmp_path / 'run'}")
    assert code == 2 and f"model.path={hf_dir}: {shard} is not a complete safetensors file" in output
    assert not (tmp_path / "run").exists()


def test_check_of_eval_and_compare_writes_nothing(tmp_path, capsys, tiny_checkpoint):
    hf_dir = tiny_checkpoint(DEMO_MODEL)
    assert main(["eval", DEMO, "--hf-dir", str(hf_dir), "--check"]) == 0
    assert capsys.readouterr().out.strip() == (f"config ok: would evaluate Hugging Face model {hf_dir} on "
                                               "procedural:add (64 questions)")
    out = tmp_path / "compare"
    assert main(["compare", DEMO, "--losses", "bpo,grpo", "--seeds", "1", "--out", str(out), "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("config ok")] == [
        f"config ok: bpo-s1 -> {out / 'bpo-s1'}", f"config ok: grpo-s1 -> {out / 'grpo-s1'}"]
    assert not out.exists()
    # --sweep reads launch's grid grammar: axes multiply, points are named as launch names them
    sweep = ["--sweep", "loss.bpo_eps=0.05,0.2", "--sweep", "loss.bpo_cap=2,3"]
    assert main(["compare", DEMO, "--losses", "bpo", *sweep, "--seeds", "1", "--out", str(out), "--check"]) == 0
    names = [line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("config ok")]
    points = [f"bpo_eps-{eps}-bpo_cap-{cap}" for eps in ("0.05", "0.2") for cap in ("2", "3")]
    assert names == [f"{point}-s1" for point in points]
    from bpo_megatron.launch import plan_batch
    from bpo_megatron.launch.settings import ExecutorSettings

    launched = plan_batch(DEMO, ["loss.bpo_eps=0.05,0.2", "loss.bpo_cap=2,3"], ExecutorSettings()).runs
    assert [run.name.removeprefix("tiny_moe_cpu-") for run in launched] == points
    # one bad variant refuses the whole comparison before its first run
    assert main(["compare", DEMO, "--losses", "bpo", "--sweep", "loss.bpo_cap=0.5,2", "--seeds", "1",
                 "--out", str(out)]) == 2
    assert "bpo_cap must be >= 1" in capsys.readouterr().err and not out.exists()


def test_eval_builds_the_runs_engine_or_refuses_it_by_name(tiny_checkpoint, capsys, monkeypatch):
    """`bpo-megatron eval` evaluates with rollout.engine as the run configures it (its spec builds
    it, with its own section), and refuses an engine this machine cannot run before any model
    loads, naming it."""
    import dataclasses
    import importlib.util

    from bpo_megatron.rollout import config as rollout_config
    from bpo_megatron.rollout.engine import engine_spec

    hf_dir = tiny_checkpoint(DEMO_MODEL)
    if importlib.util.find_spec("vllm") is None:
        assert main(["eval", DEMO, "rollout.engine=vllm", "model.routing_replay=false", "--hf-dir", str(hf_dir)]) == 2
        assert "rollout.engine=vllm needs the vllm package, which this Python lacks" in capsys.readouterr().err
    built = []
    hf = engine_spec("hf")

    def build(options, context):
        built.append((options.dtype, context.model_dir))
        return hf.build(options, context)

    patched = dataclasses.replace(hf, build=build)
    monkeypatch.setattr(rollout_config, "engine_spec", lambda name: patched if name == "hf" else engine_spec(name))
    assert main(["eval", DEMO, "rollout.hf.dtype=bf16", "eval.limit=2", "eval.k=1", "--hf-dir", str(hf_dir)]) == 0
    assert built == [("bf16", str(hf_dir))] and "Avg@1" in capsys.readouterr().out
