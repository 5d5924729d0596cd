"""The main job (python -m comet.demo) runs end to end and reports success, at a small size."""
import json
import subprocess
import sys


def test_demo_small(tmp_path):
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "comet.demo", "--world", "2", "--tokens", "32",
                        "--scale", "64", "--iters", "1", "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "on every rank: OK" in p.stdout
    res = json.loads(out.read_text())
    assert res["ok"] and res["max_error"] <= 2e-2 and len(res["results"]) == 2
