"""bench/dev/sass_probe.py's reading of nvdisasm output (the disassembler itself is not on the CI machine): opcodes
without predicates and modifiers, labels resolved to the next instruction, and loops found from backward branches,
innermost first, only those that hold a load, a shared-memory load or an MMA."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SASS = """
        .text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDS.64 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, RZ ;
.L_x_2:
        /*0030*/              @!P0 LDG.E.128 R12, desc[UR4][R10.64] ;
        /*0040*/                   IADD3 R2, R2, 0x8, RZ ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   ISETP.NE.AND P0, PT, R2, R3, PT ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
.L_x_3:
        /*0080*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0090*/               @P2 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA `(.L_x_4) ;
.L_x_4:
        /*00c0*/                   NOP ;
"""


def _probe():
    spec = importlib.util.spec_from_file_location("sass_probe", ROOT / "bench" / "dev" / "sass_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_opcodes_labels_and_hot_loops():
    probe = _probe()
    insns, labels = probe.parse_sass(SASS)
    assert len(insns) == 13
    assert labels == {".L_x_1": 0x10, ".L_x_2": 0x30, ".L_x_3": 0x80, ".L_x_4": 0xc0}
    assert [probe.opcode(t) for _, t in insns[3:6]] == ["LDG", "IADD3", "BRA"]
    found = probe.loops(insns, labels)
    # the inner loop (0x30-0x50: a load), then the outer one (0x10-0x70: LDS, HMMA, the inner loop); the loop at
    # 0x80 holds no load or MMA and the branch at 0xb0 goes forward: neither is listed
    assert [(r["start"], r["end"], r["instructions"]) for r in found] == [("0x30", "0x50", 3), ("0x10", "0x70", 7)]
    assert found[1]["mix"] == {"LDS": 1, "HMMA": 1, "LDG": 1, "IADD3": 1, "BRA": 2, "ISETP": 1}


def test_contiguous_signature_makes_every_array_argument_c_layout():
    probe = _probe()
    sig = "void(float32[:, :, :], uint64[:], int64, float32, float64[:, :], int32[:])"
    assert probe.contiguous_signature(sig) == \
        "void(float32[:, :, ::1], uint64[::1], int64, float32, float64[:, ::1], int32[::1])"
    assert probe.contiguous_signature("void(int64, float32)") == "void(int64, float32)"
