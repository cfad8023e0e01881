"""The torch versions the package admits, and the static check that keeps the code inside them.

pyproject.toml admits torch 2.11 (the GPU validation image) to 2.14.1 (the cluster environment),
CI runs 2.13. Code behind ``platform.has_cuda()`` never runs in CI, so ``tools/check_torch_names.py``
resolves every torch name the code uses against the torch it runs under; .ci/run runs it (and this
file) under torch 2.11, where the last test checks the case that failed on the GPUs."""

from __future__ import annotations

import importlib.util
import re
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_torch_names", ROOT / "tools" / "check_torch_names.py")
checker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checker)


def _window():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    return torch_req.specifier


def _pin(path: str) -> Version:
    (version,) = re.findall(r"^torch==(\S+)", (ROOT / path).read_text(), flags=re.M)
    return Version(version)


# ------------------------------------------------------------------------------ the window
def test_the_window_admits_the_gpu_image_ci_and_the_cluster_torch_and_nothing_older():
    window = _window()
    for admitted in ("2.11.0", "2.13.0", "2.14.1"):
        assert window.contains(admitted), admitted
    for refused in ("2.10.0", "2.10.1", "2.6.0", "2.15.0"):
        assert not window.contains(refused), refused


def test_every_pinned_torch_is_inside_the_window_and_the_oldest_checked_is_its_lower_bound():
    window = _window()
    pins = {path: _pin(path) for path in ("tools/constraints-cpu.txt", "tools/constraints-torch-oldest.txt",
                                          "tools/constraints-sglang.txt", "tools/gpu/requirements-cluster.txt")}
    for path, pin in pins.items():
        assert window.contains(pin), (path, pin)
    (lower,) = [Version(s.version) for s in window if s.operator == ">="]
    assert pins["tools/constraints-torch-oldest.txt"] == lower


# ------------------------------------------------------------------------------ the checker
def _check(tmp_path: Path, source: str) -> tuple[list[str], int]:
    """Names the checker reports missing in ``source`` (without file:line), and the exempted count."""
    path = tmp_path / "module.py"
    path.write_text(textwrap.dedent(source))
    missing, _unchecked, _checked, exempted, files = checker.check([str(tmp_path)])
    assert files == 1
    return [line.split(": ", 1)[1] for line in missing], exempted


@pytest.mark.parametrize("source, name", [
    ("import torch\ntorch.accelerator.no_such_fn()\n", "torch.accelerator.no_such_fn"),
    ("import torch\ntorch.ops.aten.no_such_op.default(x)\n", "torch.ops.aten.no_such_op.default"),
    ("import torch.nn.functional as F\nF.no_such(x)\n", "torch.nn.functional.no_such"),
    ("from torch.cuda import no_such\n", "torch.cuda.no_such"),
    ("from torch import no_such_module as m\n", "torch.no_such_module"),
    ("import torch.no_such_module\n", "torch.no_such_module"),
    ("def f():\n    import torch.distributed as dist\n    return dist.no_such_collective()\n",
     "torch.distributed.no_such_collective"),
    ("import torch\nif torch.cuda.is_available():\n    torch.cuda.no_such_cuda_fn()\n", "torch.cuda.no_such_cuda_fn"),
    ("import torch\nx = torch.cuda.NoSuchGraph().replay()\n", "torch.cuda.NoSuchGraph"),
    ("import torch\ndtype = getattr(torch, 'no_such_dtype')\n", "torch.no_such_dtype"),
])
def test_the_checker_names_what_torch_lacks(tmp_path, source, name):
    missing, _ = _check(tmp_path, source)
    assert missing == [name]


def test_the_checker_passes_what_torch_has(tmp_path):
    missing, _ = _check(tmp_path, """
        from __future__ import annotations
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torchx.specs import AppState  # not torch
        from torch.cuda import CUDAGraph

        def attend(q: torch.Tensor, k, v) -> torch.Tensor:
            import torch.distributed as dist
            dist.all_reduce(q)
            out = torch.ops.aten._flash_attention_forward(q, k, v)
            torch._grouped_mm(q, k, offs=v)
            graph = torch.cuda.CUDAGraph().replay
            torch.backends.cuda.matmul.allow_tf32 = True  # assigned: checks torch.backends.cuda.matmul
            torch.no_such_attribute_set_here = 1  # assigned: checks torch
            getattr(torch, "no_such_but_guarded", None)
            return F.scaled_dot_product_attention(q, k, v) + nn.Linear(2, 2)(out) * getattr(torch, "bfloat16")
        """)
    assert missing == []


def test_the_exemption_comment_skips_a_guarded_name_and_is_counted(tmp_path):
    missing, exempted = _check(tmp_path, """
        import torch
        if hasattr(torch.accelerator, "no_such_fn"):
            torch.accelerator.no_such_fn()  # torch-window: newer torch only
        """)
    assert (missing, exempted) == ([], 1)


def test_the_checker_exits_1_naming_file_line_and_torch_version(tmp_path, capsys):
    (tmp_path / "a.py").write_text("import torch\n\ntorch.accelerator.no_such_fn()\n")
    assert checker.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{tmp_path / 'a.py'}:3: torch.accelerator.no_such_fn (not in torch {torch.__version__})"
    assert out[-1].startswith("torch names: 2 uses checked in 1 files against torch ")
    (tmp_path / "a.py").write_text("import torch\n")
    assert checker.main([str(tmp_path)]) == 0


# ------------------------------------------------------------------------------ under torch 2.11
# offload.py at b4ca8c3: the checkpoint save that failed on every GPU with torch 2.11
OLD_OFFLOAD = """
import torch

from bpo_megatron import platform


def release_host_cache() -> None:
    if platform.has_cuda():
        torch.accelerator.empty_host_cache()
"""


@pytest.mark.skipif(not torch.__version__.startswith("2.11."), reason="needs torch 2.11 (.ci/run: .torch-oldest)")
def test_under_torch_2_11_the_old_host_cache_call_is_named_and_the_package_passes(tmp_path):
    (tmp_path / "offload.py").write_text(OLD_OFFLOAD)
    missing, *_ = checker.check([str(tmp_path)])
    assert missing == [f"{tmp_path / 'offload.py'}:9: torch.accelerator.empty_host_cache"]
    missing, unchecked, checked, exempted, files = checker.check([str(ROOT / "bpo_megatron")])
    assert (missing, unchecked) == ([], [])
    assert checked > 1000 and files > 200
    assert torch.version.cuda is not None  # the GPU image's build: CUDA-only names resolve
