"""tools/gpu_check.sh, the one command a GPU machine runs: its report machinery, checked here on a
step that needs no GPU (the build guard's tests): the step's command line, its output's tail,
exit code and time land in report.md, and only the steps asked for run."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_a_step_is_reported_with_its_command_exit_code_and_output(tmp_path):
    env = dict(os.environ, GPU_CHECK_STEPS="guard", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# comet GPU check, ")
    assert "## guard" in report and "-m pytest tests/test_build_guard.py" in report
    assert "passed" in report and "exit 0 after" in report
    assert "## build" not in report  # only the steps asked for
    assert (tmp_path / "guard.log").exists()
