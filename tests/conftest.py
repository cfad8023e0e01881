"""Fixtures shared by the test suite, and where the rest of the test kit lives.

* The tests' one tiny MoE is ``bpo_megatron/testing/configs/tiny_qwen3_moe`` (head_dim ≠
  hidden/heads and a vocabulary that gives both TP=2 shards real tokens); ``tiny_gpt.py`` builds
  the same sizes as a plain Megatron GPT. End-to-end tests run the CPU demo's own model instead.
  Every model family has a tiny config there, ``tiny_<model_type>``, and its test data in
  ``tests/family_kit.py``: ``tests/test_model_families.py`` runs one contract over them all, the
  families' own modules (``tests/test_glm4_moe.py``, ``tests/test_deepseek_v3.py``) what only one has.
* Code that runs inside gloo ranks cannot use fixtures: ``bpo_megatron.testing`` (the kit the
  benchmarks and the GPU kit use too) holds the one train actor builder (``build_actor``, through
  ``TrainerSpec``) and the sample makers; ``bpo_megatron.parallel.local_world`` starts the ranks
  (one torch thread each, 127.0.0.1, a timeout, every process reaped).

* ``ray_session``: one embedded Ray for the whole session (starting one takes ~20 s here),
  bound to loopback, never joining a cluster this machine may know of. A loop run inside it
  leaves it running (``run`` stops only a Ray it started itself).
* ``family_models``: each family's tiny random checkpoints and R3 reference
  (``tests/family_kit.py``), made once per session for the contract and the families' own tests.
* ``small_run``: the CPU demo experiment cut to a few small steps, in a given run directory.
* ``tiny_checkpoint``: the one maker of random Hugging Face checkpoints for the tests, each made once
  a session per model and seed and shared by every module that asks for it. They are read-only: a
  test that writes into a checkpoint (cuts a shard, edits its config) makes its own with
  ``bpo_megatron.testing.random_checkpoint``. What a test writes beside one (the block-FP8 copy an
  FP8 engine starts from) stays in that checkpoint's own folder.
* ``confinable``: the tool sandbox runs here; skipped, saying why, only where the host lacks what
  it needs (``unshare``, user namespaces, libseccomp2, a way to bound threads, an unmasked
  ``/proc``) — a sandbox that fails on a host that has all of it fails the test.
* Megatron-Core's import-time warnings (apex and transformer-engine absent on CPU) are
  silenced once here; gloo ranks silence them in their fork server
  (``bpo_megatron.parallel.local_world``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "tiny_moe_cpu.yaml"

# The demo at the smallest size that still runs every phase: warm start, rollout, R3 training,
# weight sync with verification, evaluation and a checkpoint at every step.
SMALL_RUN = ("train.prompts_per_step=4", "rollout.group_size=4", "train.minibatches_per_step=2",
             "trainer.micro_batch_size=4", "train.sft_warmup_steps=2", "train.sft_batch_size=8", "eval.every=1",
             "eval.limit=8", "eval.k=2", "checkpoint.every=1", "checkpoint.keep_last=2",
             "weight_sync.verify=true", "logging.tensorboard=false")

logging.getLogger("megatron").setLevel(logging.ERROR)


def pytest_configure(config) -> None:
    # pytest resets warning filters around every test; these are applied to each
    config.addinivalue_line("filterwarnings", r"ignore::UserWarning:megatron\.")


@pytest.fixture(scope="session")
def ray_session():
    pytest.importorskip("ray")
    from bpo_megatron.orchestration.cluster import start_ray, stop_ray
    from bpo_megatron.orchestration.config import ClusterConfig

    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_ADDRESS", raising=False)
        env.setenv("RAY_AUTH_MODE", "disabled")
        start_ray(ClusterConfig(object_store_mb=384), cpus_needed=4)
        try:
            yield
        finally:
            stop_ray()


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    from family_kit import FamilyModels

    return FamilyModels(tmp_path_factory)


@pytest.fixture(scope="session")
def confinable():
    import ctypes.util
    import shutil
    import subprocess

    from bpo_megatron.rollout.agents.sandbox import SandboxConfig, SandboxUnavailable, check_confinement, task_bound

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("the tool sandbox needs util-linux's unshare, which this host lacks")
    done = subprocess.run([unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"this host lets no user namespace be made: {done.stderr.strip()[-200:]}")
    if ctypes.util.find_library("seccomp") is None:
        pytest.skip("the tool sandbox needs the system's libseccomp2, which this host lacks")
    try:
        task_bound()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    try:
        check_confinement(SandboxConfig())
    except SandboxUnavailable as exc:  # a masked /proc is the host's; anything else is the sandbox's fault
        if "a fresh /proc cannot be mounted" not in str(exc):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(model, seed=0)``: the random checkpoint (:func:`bpo_megatron.testing.random_checkpoint`)
    of ``model``, the name of one of the kit's tiny configs (``tiny_qwen3_moe``, ``tiny_qwen3``,
    ``tiny_glm4_moe``, ``tiny_deepseek_v3``) or a config's folder or ``config.json``; made once a session."""
    from bpo_megatron.testing import MODEL_CONFIGS, random_checkpoint

    made: dict[tuple[Path, int], Path] = {}

    def checkpoint(model: str | Path, seed: int = 0) -> Path:
        config = Path(model) if Path(model).is_absolute() else MODEL_CONFIGS / model
        config = (config.parent if config.suffix == ".json" else config).resolve()
        if not (config / "config.json").is_file():
            raise FileNotFoundError(f"tiny_checkpoint: no config.json in {config} (name one of "
                                    f"{sorted(p.name for p in MODEL_CONFIGS.iterdir() if p.is_dir())} or a config's folder)")
        if (config, seed) not in made:
            # each in a folder of its own, so what a test writes beside it stays with it
            made[config, seed] = random_checkpoint(config, tmp_path_factory.mktemp(f"{config.name}-seed{seed}") / "model",
                                                   seed=seed)
        return made[config, seed]

    return checkpoint


@pytest.fixture(scope="session")
def small_run():
    """``small_run(run_dir, *overrides)``: the few-step demo experiment writing into ``run_dir``."""
    from bpo_megatron.experiment import load_experiment

    def config(run_dir: Path, *overrides: str):
        return load_experiment(DEMO, [*SMALL_RUN, f"logging.run_dir={run_dir}", *overrides])

    return config
