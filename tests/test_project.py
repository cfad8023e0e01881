"""The README's promises: the quick start and CI run the same commands."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_quick_start_has_exactly_two_commands_both_setting_up_first():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert all(cmd.startswith("bash tools/setup.sh && ") for cmd in commands)


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _quick_start_commands()[1]
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == test_command
