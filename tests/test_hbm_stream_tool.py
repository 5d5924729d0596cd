"""tools/hbm_stream.py without a GPU: the model's column it prints beside the measurement, against
the rule written here (a streaming block reads the smaller of its SM's share of HBM and its bytes
in flight over 1 us; b blocks b times that), its JSON, and its refusals."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import hbm_stream  # noqa: E402


def test_model_column_without_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hbm_stream.main(["--blocks", "1,8,200", "--loads", "1,8", "--gpu", "h800",
                            "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "no measurement (no CUDA GPU): the model's column only" in text
    got = json.loads((tmp_path / "hbm_stream.json").read_text())
    assert got["measured"] is False and got["sm_count"] == 132
    share = 3350e9 * 0.8 / 132  # H800: 3.35 TB/s at 80% over 132 SMs, per SM
    want = {}
    for loads in (1, 8):
        in_flight = 256 * loads * 16
        for blocks in (1, 8, 132):  # 200 blocks: capped at the SMs
            want[(blocks, loads)] = blocks * min(share, in_flight / 1e-6) / 1e9
    rows = {(r["blocks"], r["loads"]): r for r in got["rows"]}
    assert set(rows) == set(want)
    for key, gbs in want.items():
        assert rows[key]["model_gbs"] == pytest.approx(gbs, rel=1e-12)
        assert rows[key]["gbs"] is None
        assert f"| {key[0]} | {key[1]} | {256 * key[1] * 16} | - | {gbs:.0f} | - |" in text
    # 1 load of 16 bytes per thread: Little's law bounds the block (4.1 GB/s < 20.3)
    assert rows[(1, 1)]["model_gbs"] == pytest.approx(4.096)


@pytest.mark.parametrize("args", [["--loads", "3"], ["--blocks", "0"], ["--threads", "100"],
                                  ["--blocks", "x"], ["--gpu", "nope"]])
def test_bad_arguments_are_refused(tmp_path, monkeypatch, args):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        hbm_stream.main(args + ["--out", str(tmp_path)])
    assert "hbm_stream" in str(e.value)


def test_runs_as_a_file_with_help():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "hbm_stream.py"), "--help"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and "--loads" in p.stdout and "hbm_read_bench" in p.stdout
