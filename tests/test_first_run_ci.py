"""``.ci/run`` announces each stage and runs exactly the README's test command."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.name != "posix", reason="a bash script")
def test_ci_run_stages_are_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    command = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[1].strip()
    proc = subprocess.run(
        ["bash", str(REPO / ".ci" / "run")], env=dict(os.environ, CI_DRY_RUN="1"),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    stages = [line.split("] ", 1)[1] for line in lines if line.startswith("==> ")]
    assert f"the README's test command: {command}" in stages
    steps = stages[stages.index(f"the README's test command: {command}") + 1 : -1]
    assert " && ".join(s.split("   (")[0] for s in steps) == command
    assert stages[-1] == "done: exit status 0"
