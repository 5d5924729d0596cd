"""The main job (python -m comet.demo) runs end to end and reports success, at a small size; user
mistakes on its command line are refused before any rank spawns."""
import json
import subprocess
import sys
import time

import pytest

from comet import demo


def test_demo_small(tmp_path):
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "comet.demo", "--world", "2", "--tokens", "32",
                        "--scale", "64", "--iters", "1", "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "on every rank: OK" in p.stdout
    res = json.loads(out.read_text())
    assert res["ok"] and res["max_error"] <= 2e-2 and len(res["results"]) == 2


# ------------------------------------------------------------------------------------------------
# User mistakes: refused before any rank spawns, one line, status 2, no traceback
# ------------------------------------------------------------------------------------------------

BAD_ARGS = [
    (["--world", "3"], "--world 3: the ranks must divide Mixtral's 8 experts"),
    (["--world", "0"], "--world 0: the ranks must divide"),
    (["--world", "-2"], "--world -2"),
    (["--scale", "3"], "--scale 3: must divide"),
    (["--scale", "0"], "--scale 0"),
    (["--tokens", "-1"], "--tokens -1"),
    (["--iters", "0"], "--iters 0"),
    (["--timeout", "0"], "--timeout 0"),
    (["--json", "/nonexistent-dir/x.json"], "no directory"),
]


def _no_spawn(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("comet.demo started processes before validating its arguments")
    monkeypatch.setattr(demo.mp, "get_context", refuse)


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_are_refused_before_anything_spawns(argv, message, monkeypatch, capsys):
    _no_spawn(monkeypatch)
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_device_cuda_without_a_gpu_is_one_clear_line(monkeypatch, capsys):
    _no_spawn(monkeypatch)
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        demo.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda: no GPU is visible" in capsys.readouterr().err


def test_device_cuda_needs_a_gpu_per_rank_and_a_half_dtype(monkeypatch, capsys):
    """What a machine with 2 GPUs and a CUDA build would refuse (faked: no GPU here)."""
    from comet.buffers import symm_cuda

    _no_spawn(monkeypatch)
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(demo.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(symm_cuda, "available", lambda: True)
    for argv, message in ((["--world", "4"], "one GPU per rank, but only 2 visible"),
                          (["--world", "2", "--dtype", "fp32"], "take bf16 or fp16")):
        with pytest.raises(SystemExit) as e:
            demo.main(["--device", "cuda", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_command_line_mistake_fails_fast_without_traceback():
    """As a user meets it: the process ends with status 2 and one error line, in about the time
    `import comet` takes (~5 s on the loaded 2-core CI machine; the ranks never start)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "comet.demo", "--world", "3"],
                       capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "[comet.demo]" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("python -m comet.demo: error: --world 3")
    assert elapsed < 20, elapsed


def test_help_describes_every_option():
    parser = demo.build_parser()
    assert all(action.help for action in parser._actions), \
        [action.dest for action in parser._actions if not action.help]
    assert "python -m comet.demo [--world 4]" in parser.format_help()  # the description, whole
