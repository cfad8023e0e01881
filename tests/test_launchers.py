"""Launchers: the Slurm script and the KubeRay manifest render offline with what a cluster needs;
a sweep is one job per grid point; the local launcher runs the CPU demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bpo_megatron.launch import launch, plan_batch
from bpo_megatron.launch.settings import ExecutorSettings
from bpo_megatron.config.grid import split_grid

ROOT = Path(__file__).resolve().parents[1]
RECIPE_30B = "configs/qwen3_30b_a3b_bpo.yaml"  # as the driver sees it: relative to the shipped code
RECIPE_4B = "configs/qwen3_4b_ablation.yaml"
IMAGE = "nvcr.io/nvidia/nemo:25.09"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # NeMo-Run keeps records under its home; recipes are given relative to the repository
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemo_run"))
    monkeypatch.chdir(ROOT)
    # NeMo-Run runs local shell steps through invoke, which reads stdin: give it an empty one
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        yield


def _cluster_settings(tmp_path, **extra) -> ExecutorSettings:
    return ExecutorSettings(
        nodes=4, gpus_per_node=8, container_image=IMAGE, mounts=("/lustre/data:/data", "/lustre/models:/models"),
        env={"NCCL_DEBUG": "WARN"}, setup=("pip install --no-deps -e /nemo_run/code",),
        account="rl_team", partition="batch", time="08:00:00", remote_dir="/lustre/rl/bpo-jobs",
        packager="none", home=str(tmp_path / "nemo_run"), **extra)


def _driver_line(script: str) -> str:
    block = script.split("DRIVER=$(cat <<'BPO_DRIVER'\n", 1)[1]
    return block.split("\nBPO_DRIVER", 1)[0]


def test_slurm_script_for_4_nodes_of_8_gpus(tmp_path):
    [job] = launch("slurm", RECIPE_30B, ["model.path=/models/Qwen3-30B-A3B-Base"], _cluster_settings(tmp_path),
                   dryrun=True)
    text = job.text
    assert job.kind == "sbatch" and job.name == "qwen3_30b_a3b_bpo"
    for flag in ("--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=1", "--account=rl_team",
                 "--partition=batch", "--time=08:00:00", "--job-name=bpo-qwen3_30b_a3b_bpo"):
        assert f"#SBATCH {flag}\n" in text, flag
    assert "export NCCL_DEBUG=WARN" in text
    # every Ray node runs in the container, with the mounts and NeMo-Run's job directory
    ray_sruns = [line for line in text.splitlines() if line.startswith(("srun --container-image", "  srun --container-image"))]
    assert len(ray_sruns) == 2  # head, then the worker loop
    for line in ray_sruns:
        assert f"--container-image={IMAGE}" in line and "/lustre/data:/data,/lustre/models:/models" in line
        assert ":/nemo_run," in line and "-A=" not in line and "--mpi" not in line
    assert "ray start --head --node-ip-address=$head_ip --port=$RAY_PORT" in text
    assert "ray start --address=$ray_address" in text
    assert "for ((i = 1; i < SLURM_JOB_NUM_NODES; i++))" in text
    assert "pip install --no-deps -e /nemo_run/code" in text.split("SETUP=$(cat <<'BPO_SETUP'")[1]
    # the driver: bpo-megatron train on the head node, attached to this Ray cluster
    assert _driver_line(text) == ("bpo-megatron train configs/qwen3_30b_a3b_bpo.yaml "
                                  "model.path=/models/Qwen3-30B-A3B-Base cluster.nodes=4 cluster.gpus_per_node=8")
    assert 'bash -c "$DRIVER cluster.ray_address=$ray_address"' in text
    assert "--container-name=ray-head --container-workdir=/nemo_run/code" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_slurm_driver_arguments_are_shell_quoted(tmp_path):
    [job] = launch("slurm", RECIPE_30B, ["logging.run_dir=/lustre/runs/{name} x"],
                   _cluster_settings(tmp_path), dryrun=True)
    assert "'logging.run_dir=/lustre/runs/{name} x'" in _driver_line(job.text)


def test_sweep_renders_one_job_per_grid_point(tmp_path):
    losses = ["bpo", "grpo", "gspo", "cispo", "dppo_tv"]
    jobs = launch("slurm", RECIPE_30B, ["loss.name=" + ",".join(losses)], _cluster_settings(tmp_path), dryrun=True)
    assert [j.name for j in jobs] == [f"qwen3_30b_a3b_bpo-loss-{loss}" for loss in losses]
    for loss, job in zip(losses, jobs):
        driver = _driver_line(job.text)
        assert f" loss.name={loss} " in driver and driver.endswith(f"name=qwen3_30b_a3b_bpo-loss-{loss}")
        assert f"#SBATCH --job-name=bpo-qwen3_30b_a3b_bpo-loss-{loss}\n" in job.text
    # one NeMo-Run experiment: every job directory sits under the same experiment id
    experiment_dirs = {re.search(r"LOG_DIR=/lustre/rl/bpo-jobs/qwen3_30b_a3b_bpo/([^/]+)/", j.text).group(1)
                       for j in jobs}
    assert len(experiment_dirs) == 1


def test_two_axis_grid_and_its_names():
    batch = plan_batch(RECIPE_4B, ["loss.bpo_eps=0.05,0.1,0.2,0.3", "loss.bpo_cap=2,3,4"], ExecutorSettings())
    assert len(batch.runs) == 12 and batch.title == "qwen3_4b_ablation"
    assert len({r.name for r in batch.runs}) == 12
    assert batch.runs[0].name == "qwen3_4b_ablation-bpo_eps-0.05-bpo_cap-2"
    assert batch.runs[0].overrides[-3:] == ("loss.bpo_eps=0.05", "loss.bpo_cap=2",
                                            "name=qwen3_4b_ablation-bpo_eps-0.05-bpo_cap-2")


def test_grid_parsing_keeps_yaml_lists_whole():
    fixed, axes = split_grid(["eval.datasets=[aime24,aime25]", "loss.name=bpo,grpo", "train.steps=3"])
    assert fixed == ["eval.datasets=[aime24,aime25]", "train.steps=3"]
    assert axes == [("loss.name", ["bpo", "grpo"])]
    with pytest.raises(ValueError, match="name cannot be swept"):
        split_grid(["name=a,b"])


def test_kuberay_manifest(tmp_path):
    settings = _cluster_settings(tmp_path, namespace="rl")
    settings = ExecutorSettings(**{**settings.__dict__, "mounts": ("models-pvc:/models", "/raid/data:/data")})
    [job] = launch("kuberay", RECIPE_30B, ["model.path=/models/Qwen3-30B-A3B-Base"], settings, dryrun=True)
    manifest = yaml.safe_load(job.text)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert manifest["metadata"]["namespace"] == "rl"
    spec = manifest["spec"]
    assert spec["entrypoint"].startswith("bpo-megatron train configs/qwen3_30b_a3b_bpo.yaml "
                                         "model.path=/models/Qwen3-30B-A3B-Base")
    assert spec["entrypoint"].endswith("cluster.ray_address=auto")
    [workers] = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == 4
    [worker] = workers["template"]["spec"]["containers"]
    assert worker["image"] == IMAGE and worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in worker["env"]
    assert worker["lifecycle"]["postStart"]["exec"]["command"][-1] == "pip install --no-deps -e /nemo_run/code"
    volumes = workers["template"]["spec"]["volumes"]
    assert {"name": "mount-0", "persistentVolumeClaim": {"claimName": "models-pvc"}} in volumes
    assert {"name": "mount-1", "hostPath": {"path": "/raid/data"}} in volumes


def test_kuberay_manifest_is_what_nemo_run_submits(tmp_path, monkeypatch):
    import nemo_run  # noqa: F401  (NeMo-Run's Ray helpers import after the package)
    from nemo_run.run.ray import kuberay as nemo_kuberay

    from bpo_megatron.launch import kuberay
    from bpo_megatron.launch.base import Resources

    # KubeRayJob reads a kube config on construction; the dry run needs none
    monkeypatch.setattr(nemo_kuberay.config, "load_kube_config", lambda *a, **k: None)
    settings = _cluster_settings(tmp_path)
    run_ = plan_batch(RECIPE_30B, ["loss.bpo_eps=0.2"], settings).runs[0]
    user = nemo_kuberay.get_user()
    name = kuberay.k8s_name(run_.name, user)
    ours = kuberay.rayjob_manifest(name, kuberay.executor(settings, Resources(4, 8)), kuberay.entrypoint(run_), user)
    theirs = nemo_kuberay.KubeRayJob(name=name, executor=kuberay.executor(settings, Resources(4, 8))).start(
        command=kuberay.entrypoint(run_), dryrun=True)
    assert ours == theirs
    assert len(f"{user}-{kuberay.k8s_name('x' * 80, user)}-rayjob-raycluster") <= 63


def test_bad_launches_fail_before_submitting(capsys):
    from bpo_megatron.cli import main

    assert main(["launch", "slurm", RECIPE_30B, "loss.name=bpo,ppo", "--dryrun"]) == 2
    assert "PolicyLossConfig.name='ppo' is unknown" in capsys.readouterr().err
    assert main(["launch", "kuberay", RECIPE_30B, "--dryrun"]) == 2
    assert "--container-image" in capsys.readouterr().err
    assert main(["launch", "slurm", RECIPE_30B, "--mounts", "nocolon", "--dryrun"]) == 2
    assert "SRC:/container/path" in capsys.readouterr().err


def test_local_dryrun_is_the_train_command():
    [job] = launch("local", "configs/tiny_moe_cpu.yaml", ["train.steps=2"], ExecutorSettings(), dryrun=True)
    assert job.kind == "command"
    assert job.text == f"{sys.executable} -m bpo_megatron.cli train {ROOT / 'configs/tiny_moe_cpu.yaml'} train.steps=2"


@pytest.mark.slow  # CI time (≈ 60 s; the dry runs of every launcher stay): run with -m slow
def test_local_launcher_runs_the_cpu_demo(tmp_path):
    """The CPU demo for 2 small SFT + 2 small RL steps through NeMo-Run's local executor (Ray starts
    inside)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(NEMORUN_HOME=str(tmp_path / "nemo_run"), RAY_AUTH_MODE="disabled")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "bpo_megatron.cli", "launch", "local", str(ROOT / "configs" / "tiny_moe_cpu.yaml"),
           "train.steps=2", "train.sft_warmup_steps=2", "train.sft_batch_size=8", "train.prompts_per_step=4",
           "rollout.group_size=4", "trainer.micro_batch_size=4", "eval.every=0", "checkpoint.every=0",
           f"logging.run_dir={run_dir}", "logging.progress=false", "--home", str(tmp_path / "nemo_run")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tiny_moe_cpu: SUCCEEDED" in proc.stdout
    assert "done: 2 steps" in proc.stdout
    steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert steps
    assert (tmp_path / "nemo_run" / "experiments" / "tiny_moe_cpu").is_dir()


def test_slurm_ray_nodes_take_the_cpus_of_their_node(tmp_path):
    """Under cgroup confinement a job step gets the CPUs it asks for: each Ray node step asks for
    all the job has on its node (or --cpus-per-node), exactly, and tells Ray so."""
    [job] = launch("slurm", RECIPE_30B, [], _cluster_settings(tmp_path), dryrun=True)
    ray_sruns = [line for line in job.text.splitlines() if "--container-name=ray-head" in line or
                 "--container-name=ray-worker" in line]
    starts = [line for line in job.text.splitlines() if line.startswith("ray start")]
    steps = [line for line in job.text.splitlines() if "--exact --cpus-per-task=$CPUS_PER_NODE" in line]
    assert len(steps) == 2 and len(starts) == 2 and ray_sruns
    assert all("--num-cpus=$CPUS_PER_NODE" in line for line in starts)
    assert "CPUS_PER_NODE=${BPO_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:?" in job.text
    assert "export BPO_CPUS_PER_NODE" not in job.text
    [pinned] = launch("slurm", RECIPE_30B, [], _cluster_settings(tmp_path, cpus_per_node=96), dryrun=True)
    assert "export BPO_CPUS_PER_NODE=96" in pinned.text
    resolved = subprocess.run(["bash", "-c", pinned.text.split("RAY_START_TIMEOUT=")[0].split("set -uo pipefail")[1]
                               + "\nCPUS_PER_NODE=${BPO_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:?}}; echo $CPUS_PER_NODE"],
                              capture_output=True, text=True, env={"PATH": os.environ["PATH"], "SLURM_CPUS_ON_NODE": "224"})
    assert resolved.stdout.split()[-1] == "96"


def test_kuberay_pods_request_cpus_memory_and_a_memory_backed_dev_shm(tmp_path):
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.planner.host import driver_memory_gib

    [job] = launch("kuberay", RECIPE_30B, ["model.path=/models/Qwen3-30B-A3B-Base"], _cluster_settings(tmp_path),
                   dryrun=True)
    spec = yaml.safe_load(job.text)["spec"]["rayClusterSpec"]
    [workers] = spec["workerGroupSpecs"]
    [worker] = workers["template"]["spec"]["containers"]
    assert worker["resources"]["requests"] == {"cpu": "128", "memory": "768Gi", "nvidia.com/gpu": 8}
    assert worker["resources"]["limits"]["memory"] == "768Gi"
    for pod in (workers["template"], spec["headGroupSpec"]["template"]):
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "384Gi"}} in pod["spec"]["volumes"]
        [container] = pod["spec"]["containers"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # the head holds a step's samples twice: 256 × 16 responses of ≤ 18,432 tokens with 48 × 8 routed
    # experts each (uint8) → 27.8 GiB; the recipe's own architecture file sizes it
    [head] = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert driver_memory_gib(load_experiment(RECIPE_30B)) == 72
    assert head["resources"]["requests"]["memory"] == "72Gi"
    [given] = launch("kuberay", RECIPE_30B, [], _cluster_settings(tmp_path, cpus_per_node=64, memory_per_node="900Gi"),
                     dryrun=True)
    [worker] = yaml.safe_load(given.text)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"]
    assert worker["resources"]["requests"]["cpu"] == "64" and worker["resources"]["requests"]["memory"] == "900Gi"


def _worker_memory_gib(job) -> tuple[int, int]:
    [worker] = yaml.safe_load(job.text)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"]
    request, limit = (worker["resources"][kind]["memory"] for kind in ("requests", "limits"))
    return int(request.removesuffix("Gi")), int(limit.removesuffix("Gi"))


def test_kuberay_worker_memory_holds_the_planners_host_memory_at_a_checkpoint_save(tmp_path):
    """The worker pods' memory request and limit cover the host memory the planner gives the
    busiest trainer node at a checkpoint save: the per-GPU default when it is enough, the
    planner's figure when it is more; a --memory-per-node below it is refused by name."""
    import math

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.planner import make_plan
    from bpo_megatron.planner.plan import node_memory_gib

    def planned(*overrides: str) -> int:
        cfg = load_experiment(RECIPE_30B, list(overrides), check_model=False)
        figure = node_memory_gib(cfg)
        host = make_plan(cfg, cfg.hf_config()).host
        assert figure == math.ceil(max(host.at_save, host.at_load) / 2**30)
        return figure

    # the recipe: 377 GiB at a save (each rank its own optimizer shard) fits the default of 96 GiB
    # per GPU (768 GiB)
    assert planned() == 377
    [job] = launch("kuberay", RECIPE_30B, ["model.path=/models/Qwen3-30B-A3B-Base"], _cluster_settings(tmp_path),
                   dryrun=True)
    assert _worker_memory_gib(job) == (768, 768)
    # the same on one node of 8 ranks (dp 2, expert dp 1): larger shards, 940 GiB at a save, above the default
    one_node = ("cluster.nodes=1", "cluster.trainer_ranks=8")
    assert planned(*one_node) == 940
    [small] = launch("kuberay", RECIPE_30B, list(one_node), _cluster_settings(tmp_path), dryrun=True)
    assert _worker_memory_gib(small) == (940, 940)
    dshm = yaml.safe_load(small.text)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "470Gi"}} in dshm
    with pytest.raises(ValueError, match=r"--memory-per-node 256Gi is less than the 377Gi a trainer node holds at a "
                                         r"checkpoint save .* pass --memory-per-node 377Gi or more"):
        launch("kuberay", RECIPE_30B, [], _cluster_settings(tmp_path, memory_per_node="256Gi"), dryrun=True)


def test_a_trainer_rank_binds_its_own_gpu(monkeypatch):
    """Ray gives each rank one visible GPU; under torchrun or Slurm LOCAL_RANK picks it."""
    import torch

    from bpo_megatron import platform

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert platform.bind_device() == torch.device("cuda", 3) and chosen == [torch.device("cuda", 3)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.bind_device() == torch.device("cpu") and len(chosen) == 1


def test_the_cluster_launch_script_renders_its_jobs(tmp_path):
    """launchers/cluster.py, the file a user edits, runs as shipped: a dry run prints one sbatch
    script per job (the BPO run, then the grid's two), rendered from the template the installed
    package carries."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "launchers/cluster.py", "--home", str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = re.findall(r"^# ---- (\S+) \((\w+)\) ----$", done.stdout, flags=re.M)
    assert [kind for _, kind in jobs] == ["sbatch"] * 3 and len({name for name, _ in jobs}) == 3
    assert done.stdout.count("ray start --head") == 3 and "--account=ACCOUNT" in done.stdout
    assert "loss.name=grpo" in done.stdout and "loss.name=cispo" in done.stdout


def test_the_slurm_template_is_package_data():
    from bpo_megatron.launch.slurm import RAY_TEMPLATE

    assert RAY_TEMPLATE.is_file() and "bpo_megatron" in RAY_TEMPLATE.parts and "launchers" not in RAY_TEMPLATE.parts
