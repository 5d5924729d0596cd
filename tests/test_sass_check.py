"""tools/sass_check.py on a synthetic cuobjdump -sass listing (no CUDA toolkit needed): each
function keeps the arch of the ELF section it starts in, the stats count 128-bit loads/stores
(LDGSTS, the GEMM's cp.async, excluded) and the longest run of loads between stores, and the
checks flag a layer0 kernel whose copy keeps too few loads in flight."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sass_check  # noqa: E402


def _fn(name, lines):
    body = [f"        /*{i:04x}*/  {ins} ;  /* 0x0 */" for i, ins in enumerate(lines)]
    return [f"\t\tFunction : {name}"] + body


L0 = "_ZN5comet3gpu4sm8012fused_kernelIN7cutlass10bfloat16_tELi0EEEvNS0_10CallParamsEb"
L1 = "_ZN5comet3gpu4sm8012fused_kernelIN7cutlass10bfloat16_tELi1EEEvNS0_10CallParamsEb"
COPY4 = ["LDG.E.128 R4, desc[UR4][R2.64]"] * 4 + ["STG.E.128 desc[UR4][R6.64], R4"] * 4
COPY2 = (["LD.E.128 R4, [R2.64]"] * 2 + ["ST.E.128 [R6.64], R4"] * 2) * 2
FILL = ["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]"] * 6 + ["IMAD R0, R1, R2, R3"] * 40


def listing():
    lines = ["Fatbin elf code:", "arch = sm_80"]
    lines += _fn(L0, COPY4 + FILL) + _fn(L1, COPY2 + FILL)
    lines += ["Fatbin elf code:", "arch = sm_90a"]
    lines += _fn(L0, COPY2 + FILL)
    return "\n".join(lines)


def test_functions_keep_their_sections_arch():
    got = [(arch, name) for arch, name, _ in sass_check.functions(listing())]
    assert got == [("sm_80", L0), ("sm_80", L1), ("sm_90a", L0)]


def test_stats_and_checks(tmp_path, monkeypatch):
    fns = list(sass_check.functions(listing()))
    s = sass_check.stats(fns[0][2])
    assert (s["loads"], s["stores"], s["in_flight"]) == (4, 4, 4)  # LDGSTS not counted
    s = sass_check.stats(fns[1][2])
    assert (s["loads"], s["stores"], s["in_flight"]) == (4, 4, 2)

    class Done:
        stdout = listing()

    monkeypatch.setattr(sass_check.subprocess, "run", lambda *a, **k: Done())
    rows, problems = sass_check.check("x.o", "fused.cu", "cuobjdump", 4)
    assert [(r[1], r[2], r[3]["in_flight"]) for r in rows] == [
        ("sm_80", "layer0", 4), ("sm_80", "layer1", 2), ("sm_90a", "layer0", 2)]
    assert len(problems) == 1 and "sm_90a" in problems[0] and "want 4" in problems[0]


S89_L0 = "_ZN5comet3gpu4sm8912fused_kernelILi0EEEvNS0_10CallParamsEb"
S90_FP8_L1 = "_ZN5comet3gpu4sm9012fused_kernelINS1_13Fp8GemmConfigELi1EEEvNS0_10CallParamsENT_6ParamsE"
QMMA = ["QMMA.16832.F32.E4M3.E4M3 R24, R4, R8, R24"] * 2
QGMMA = ["QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0"] * 2
HMMA = ["HMMA.16816.F32.BF16 R24, R4, R8, R24"] * 2


def _problems(monkeypatch, source, sections):
    lines = []
    for arch, fns in sections:
        lines += ["Fatbin elf code:", f"arch = {arch}"]
        for name, body in fns:
            lines += _fn(name, body)

    class Done:
        stdout = "\n".join(lines)

    monkeypatch.setattr(sass_check.subprocess, "run", lambda *a, **k: Done())
    return sass_check.check("x.o", source, "cuobjdump", 4)


def test_kind_reads_the_layer_of_every_fused_kernel():
    assert sass_check.kind(L0) == "layer0" and sass_check.kind(L1) == "layer1"
    assert sass_check.kind(S89_L0) == "layer0"  # sm89::fused_kernel<0>: no type argument first
    assert sass_check.kind(S90_FP8_L1) == "layer1"


def test_fp8_kernels_need_their_tensor_core_opcode(monkeypatch):
    rows, problems = _problems(monkeypatch, "csrc/cuda/fused_sm89_fp8_layer0.cu",
                               [("sm_89", [(S89_L0, COPY4 + QMMA + FILL)])])
    assert problems == [] and rows[0][3]["fp8_mma"] == 2
    # An mma.sync of another type (or none) is a fallback off the FP8 tensor cores.
    _, problems = _problems(monkeypatch, "csrc/cuda/fused_sm89_fp8_layer0.cu",
                            [("sm_89", [(S89_L0, COPY4 + HMMA + FILL)])])
    assert len(problems) == 1 and "QMMA.16832.F32.E4M3.E4M3" in problems[0]
    # sm_90a: QGMMA needed there; the sm_80 stub of the same source is not checked.
    stub = ["EXIT"] * 3
    rows, problems = _problems(monkeypatch, "csrc/cuda/fused_sm90_fp8_layer1.cu",
                               [("sm_80", [(S90_FP8_L1, stub)]),
                                ("sm_90a", [(S90_FP8_L1, COPY2 + QGMMA + FILL)])])
    assert problems == [] and [(r[1], r[3]["fp8_mma"]) for r in rows] == [("sm_90a", 2)]
    _, problems = _problems(monkeypatch, "csrc/cuda/fused_sm90_fp8_layer1.cu",
                            [("sm_90a", [(S90_FP8_L1, COPY2 + QMMA + FILL)])])
    assert len(problems) == 1 and "QGMMA" in problems[0] and "sm_90a" in problems[0]
    # A stub-sized kernel on the FP8 architecture is not skipped, and a missing kernel fails.
    _, problems = _problems(monkeypatch, "csrc/cuda/fused_sm90_fp8_layer1.cu",
                            [("sm_90a", [(S90_FP8_L1, stub)])])
    assert len(problems) == 1 and "QGMMA" in problems[0]
    _, problems = _problems(monkeypatch, "csrc/cuda/fused_sm89_fp8_layer1.cu",
                            [("sm_89", [("_Z6helperv", FILL)])])
    assert len(problems) == 1 and "no fused kernel" in problems[0]


HBM8 = "_ZN5comet3gpu44_GLOBAL__N__7bdece7d_11_hbm_read_cu_8b9cf40f15hbm_read_kernelILi8EEEvPK5uint4lPj"
LDG = "LDG.E.EF.128 R4, desc[UR8][R2.64]"
XOR = "LOP3.LUT R4, R5, R4, R42, 0x96, !PT"


def test_hbm_read_kernel_needs_its_loads_before_their_use(monkeypatch):
    """hbm_read_kernel<8>: eight 128-bit loads, then the XORs, passes; loads interleaved with
    their XORs four at a time (what ptxas made of it under a register limit) is flagged."""
    assert sass_check.kind(HBM8) == "hbm_read"
    filler = ["IMAD R0, R1, R2, R3"] * 40
    good = [LDG] * 8 + [XOR] * 8 + filler
    bad = ([LDG] * 4 + [XOR] * 4) * 2 + filler
    assert sass_check.stats(good)["before_use"] == 8
    assert sass_check.stats(bad)["before_use"] == 4 and sass_check.stats(bad)["in_flight"] == 8
    _, problems = _problems(monkeypatch, "hbm_read.cu", [("sm_90a", [(HBM8, good)])])
    assert problems == []
    _, problems = _problems(monkeypatch, "hbm_read.cu", [("sm_90a", [(HBM8, bad)])])
    assert len(problems) == 1 and "at most 4" in problems[0] and "want 8" in problems[0]
