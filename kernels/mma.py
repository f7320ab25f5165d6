"""Tensor-core matrix multiply-accumulate from Numba kernels, and the inline-PTX conversions and loads that feed it.

Owns:
- `mma_e4m3_device`: one warp-wide `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32` (sm_89 and later; inline
  PTX, docs/toolchain.md): D [16, 8] = A [16, 32] x B [32, 8] + C, A and B E4M3 codes, C and D FP32. Every lane of
  the warp calls it with its fragment registers (lane = 4*g + t, g = lane // 4, t = lane % 4; byte j of a register
  is element j):
    a0 = A[g, 4t..4t+3], a1 = A[g+8, 4t..4t+3], a2 = A[g, 16+4t..16+4t+3], a3 = A[g+8, 16+4t..16+4t+3];
    b0 = B[4t..4t+3, g], b1 = B[16+4t..16+4t+3, g];
    c0/d0 = (g, 2t), c1/d1 = (g, 2t+1), c2/d2 = (g+8, 2t), c3/d3 = (g+8, 2t+1).
  The simulator has no tensor cores: there every lane publishes its registers in `ex` (the warp's uint32 [32, 6]
  slice of a shared array; unused on the GPU), and each output is the exact float64 sum of its 32 products plus c,
  rounded once to FP32 (the ideal MMA). The hardware accumulates its products in its own order and precision, so
  a kernel built on it is compared with the reference within a tolerance, never bit for bit across targets; on one
  target an output depends only on its own row of A and column of B, so the same inputs give the same bits.
- `mma_f16_device`: one warp-wide `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`: D [16, 8] = A [16, 16] x
  B [16, 8] + C, A and B IEEE halves (two a register, the lower column or row in the low half), C and D FP32:
    a0 = A[g, 2t..2t+1], a1 = A[g+8, 2t..2t+1], a2 = A[g, 2t+8..2t+9], a3 = A[g+8, 2t+8..2t+9];
    b0 = B[2t..2t+1, g], b1 = B[2t+8..2t+9, g]; c and d as above. The simulator's is the ideal one, as for E4M3.
  On sm_90 this is the tensor cores' own instruction (HMMA.16816.F32), whereas the E4M3 MMA above is emulated by
  ptxas: its six operand registers are unpacked by twelve F2FP.F16.E4M3 conversions into two HMMA.16816 (seen in
  the SASS on the H200), so a kernel that can hold its operands as halves should feed them to this one.
- `mma_e4m3_f16_device`: the E4M3 MMA above with C = 0, issued as ptxas's sm_90 emulation of it (read in the SASS
  of `kernels.q4k_gemv`'s decode kernel): each operand register's two low codes converted to halves feed a first
  f16 MMA (C = 0) over the k of those codes, its two high codes a second f16 MMA chained on the first's D. The
  emulation then adds the caller's C in a separate FADD (`FADD d, RZ, d` for a zero C); this leaves that add out,
  which changes nothing but the sign of a zero D (-0 becomes +0 there). On the GPU the same HMMAs on the same
  halves in the same order: the emulation's bits. In the simulator: two ideal f16 MMAs, rounded after each.
  `mma_e4m3_f16h_device` takes B already converted (a caller that stages its activations as halves once).
- `mma_bf16_device`: one warp-wide `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, the f16 MMA's fragments
  with BF16 halves (the tensor cores' own instruction on sm_90, like the f16 one; the simulator's is the ideal one).
- `mma_u8u8_device`, `mma_u8s8_device`: one warp-wide `mma.sync.aligned.m16n8k32.row.col.s32.u8.{u8,s8}.s32`:
  D [16, 8] = A [16, 32] x B [32, 8] + C with A unsigned bytes, B unsigned / signed bytes, C and D int32, in the
  E4M3 MMA's fragment layout (a register holds four consecutive k of a row of A or a column of B). Integer products
  and sums are exact, so the simulator's twin (the exact dot products) gives the hardware's bits.
- `e4m3x8_to_f16x2_device`: the eight E4M3 codes of a uint64 (element 0 in the low byte) -> four uint32 of two
  halves each (codes 0-1, 2-3, 4-5, 6-7; the lower code in the low half), exact: four hardware
  `cvt.rn.f16x2.e4m3x2`, the register split into 16-bit parts by one PTX mov so that each conversion reads its half
  directly (no shifts); the simulator decodes in software, same bits.
- `byte_perm_device`: `prmt.b32` in its default mode (any four of the eight bytes of two words; the simulator's
  twin selects them in Python).
- `load_at_device`: ary[i + k] with a constant k folded into the load's offset (an in-bounds address of element i,
  then k elements on): loads of neighbouring words share one address computation.
- `load4_device`: four consecutive 32-bit elements of a 1-D array (uint32, int32 or float32) at a multiple of 4 in
  one 16-byte load (an LLVM vector load, so LDS.128 from shared memory and LDG.E.128 from global memory; the
  simulator reads them one by one): a lane's fragment registers staged side by side.
Does not own: what the fragments hold (the callers' layouts, e.g. kernels.q4k_gemv's tensor-core path), the E4M3
encoder and the exact decoders (kernels.fp8).
"""
import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from ds4lib.formats.fp8 import E4M3_VALUES
from kernels import inline_device
from kernels.fp8 import e4m3_decode_device, f16_of_e4m3_value_device
from kernels.pdl import grid_entry_device

__all__ = ["mma_e4m3_device", "mma_e4m3_f16_device", "mma_e4m3_f16h_device", "mma_f16_device", "mma_bf16_device",
           "mma_u8u8_device", "mma_u8s8_device",
           "e4m3x8_to_f16x2_device", "byte_perm_device",
           "load4_device", "load_at_device",
           "e4m3x8_to_f16_kernel", "byte_perm_kernel", "mma_e4m3_pair_kernel",
           "MMA_EX_WORDS", "LOAD4_ALIGN", "SIGNATURES"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
WARP = 32
MMA_EX_WORDS = 6                 # uint32 registers a lane publishes in the simulator (a0..a3, b0, b1)
LOAD4_ALIGN = None if SIM else 16   # the alignment of a shared array read by load4_device (LDS.128)


if SIM:
    _E4M3 = E4M3_VALUES.astype(np.float64)
    _A_LANE = np.array([[4 * (r % 8) + (k % 16) // 4 for k in range(32)] for r in range(16)])
    _A_BYTE = np.array([[4 * ((2 if k >= 16 else 0) + (1 if r >= 8 else 0)) + k % 4 for k in range(32)]
                        for r in range(16)])
    _B_LANE = np.array([[4 * n + (k % 16) // 4 for n in range(8)] for k in range(32)])
    _B_BYTE = np.array([[16 + 4 * (1 if k >= 16 else 0) + k % 4 for n in range(8)] for k in range(32)])

    @cuda.jit(device=True)
    def _publish_device(a0, a1, a2, a3, b0, b1, ex):
        """Every lane's six registers -> a copy of the warp's uint32 [32, 6] table, taken before the second barrier
        (after it a lane may already publish its next MMA's registers)."""
        lane = cuda.threadIdx.x % WARP
        ex[lane, 0] = a0
        ex[lane, 1] = a1
        ex[lane, 2] = a2
        ex[lane, 3] = a3
        ex[lane, 4] = b0
        ex[lane, 5] = b1
        cuda.syncwarp(0xFFFFFFFF)
        tab = np.array(ex[:, :MMA_EX_WORDS], copy=True)
        cuda.syncwarp(0xFFFFFFFF)
        return tab

    @cuda.jit(device=True)
    def _ideal_outputs_device(a, b, c0, c1, c2, c3):
        """The lane's four outputs: exact float64 dot products of its rows of A and columns of B plus c, rounded once."""
        lane = cuda.threadIdx.x % WARP
        g = lane // 4
        t = lane % 4
        return (np.float32(np.dot(a[g], b[:, 2 * t]) + np.float64(c0)),
                np.float32(np.dot(a[g], b[:, 2 * t + 1]) + np.float64(c1)),
                np.float32(np.dot(a[g + 8], b[:, 2 * t]) + np.float64(c2)),
                np.float32(np.dot(a[g + 8], b[:, 2 * t + 1]) + np.float64(c3)))

    @cuda.jit(device=True)
    def mma_e4m3_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """The simulator's ideal m16n8k32 E4M3 MMA (module docstring); `ex` the warp's uint32 [32, 6] exchange."""
        tab = _publish_device(a0, a1, a2, a3, b0, b1, ex).view(np.uint8).reshape(WARP, 4 * MMA_EX_WORDS)
        return _ideal_outputs_device(_E4M3[tab[_A_LANE, _A_BYTE]], _E4M3[tab[_B_LANE, _B_BYTE]], c0, c1, c2, c3)

    # halves of a lane's six registers viewed as 12 uint16: register j's low half is entry 2j
    _HA_LANE = np.array([[4 * (r % 8) + (k % 8) // 2 for k in range(16)] for r in range(16)])
    _HA_HALF = np.array([[2 * ((1 if r >= 8 else 0) + (2 if k >= 8 else 0)) + k % 2 for k in range(16)]
                         for r in range(16)])
    _HB_LANE = np.array([[4 * n + (k % 8) // 2 for n in range(8)] for k in range(16)])
    _HB_HALF = np.array([[2 * (4 + (1 if k >= 8 else 0)) + k % 2 for n in range(8)] for k in range(16)])

    @cuda.jit(device=True)
    def mma_f16_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """The simulator's ideal m16n8k16 f16 MMA (module docstring); `ex` the warp's uint32 [32, 6] exchange."""
        tab = _publish_device(a0, a1, a2, a3, b0, b1, ex).view(np.float16).reshape(WARP, 2 * MMA_EX_WORDS)
        return _ideal_outputs_device(tab[_HA_LANE, _HA_HALF].astype(np.float64),
                                     tab[_HB_LANE, _HB_HALF].astype(np.float64), c0, c1, c2, c3)

    @cuda.jit(device=True)
    def mma_bf16_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """The simulator's ideal m16n8k16 BF16 MMA (module docstring); `ex` the warp's uint32 [32, 6] exchange."""
        tab = _publish_device(a0, a1, a2, a3, b0, b1, ex).view(np.uint16).reshape(WARP, 2 * MMA_EX_WORDS)
        vals = (tab.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
        return _ideal_outputs_device(vals[_HA_LANE, _HA_HALF], vals[_HB_LANE, _HB_HALF], c0, c1, c2, c3)

    @cuda.jit(device=True)
    def _int_outputs_device(a, b, c0, c1, c2, c3):
        """The lane's four int32 outputs: exact integer dot products of its rows of A and columns of B plus c."""
        lane = cuda.threadIdx.x % WARP
        g = lane // 4
        t = lane % 4
        return (np.int32(np.dot(a[g], b[:, 2 * t]) + c0), np.int32(np.dot(a[g], b[:, 2 * t + 1]) + c1),
                np.int32(np.dot(a[g + 8], b[:, 2 * t]) + c2), np.int32(np.dot(a[g + 8], b[:, 2 * t + 1]) + c3))

    @cuda.jit(device=True)
    def mma_u8u8_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """The simulator's m16n8k32 u8 x u8 + int32 MMA (exact, as the hardware's); `ex` the warp's exchange."""
        tab = _publish_device(a0, a1, a2, a3, b0, b1, ex).view(np.uint8).reshape(WARP, 4 * MMA_EX_WORDS)
        return _int_outputs_device(tab[_A_LANE, _A_BYTE].astype(np.int64), tab[_B_LANE, _B_BYTE].astype(np.int64),
                                   c0, c1, c2, c3)

    @cuda.jit(device=True)
    def mma_u8s8_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """The simulator's m16n8k32 u8 x s8 + int32 MMA (exact); `ex` the warp's exchange."""
        tab = _publish_device(a0, a1, a2, a3, b0, b1, ex).view(np.uint8).reshape(WARP, 4 * MMA_EX_WORDS)
        return _int_outputs_device(tab[_A_LANE, _A_BYTE].astype(np.int64),
                                   tab[_B_LANE, _B_BYTE].view(np.int8).astype(np.int64), c0, c1, c2, c3)

    @cuda.jit(device=True)
    def load4_device(ary, i):
        """ary[i], ary[i + 1], ary[i + 2], ary[i + 3] (the GPU's is one 16-byte load)."""
        return ary[i], ary[i + 1], ary[i + 2], ary[i + 3]

    @cuda.jit(device=True)
    def load_at_device(ary, i, k):
        """ary[i + k] (the GPU's folds a constant k into the load's offset)."""
        return ary[i + k]

    # every code's half bits by the software decode (the one definition: kernels.fp8), looked up per code below
    _F16_OF_CODE = np.array([int(f16_of_e4m3_value_device(e4m3_decode_device(np.uint32(c)))) for c in range(256)],
                            dtype=np.uint64)

    @cuda.jit(device=True)
    def e4m3x8_to_f16x2_device(word):
        """Eight E4M3 codes (a uint64, element 0 in the low byte) -> four uint32 of two halves each: codes 0-1, 2-3,
        4-5, 6-7 (the simulator: the software decode of each code, from a table)."""
        h = _F16_OF_CODE[np.array([word], dtype=np.uint64).view(np.uint8)]
        p = (h[0::2] | (h[1::2] << np.uint64(16))) & np.uint64(0xFFFFFFFF)
        return np.uint32(p[0]), np.uint32(p[1]), np.uint32(p[2]), np.uint32(p[3])

    @cuda.jit(device=True)
    def byte_perm_device(a, b, sel):
        """prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of the pair (b, a), a's bytes 0-3,
        b's 4-7; sel's nibbles below 8 (sign replication is not used)."""
        ab = (np.uint64(b) << np.uint64(32)) | np.uint64(a)
        out = np.uint32(0)
        for i in range(4):
            j = (np.uint32(sel) >> np.uint32(4 * i)) & np.uint32(7)
            out |= np.uint32((ab >> np.uint64(8 * j)) & np.uint64(0xFF)) << np.uint32(8 * i)
        return out
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    def _mma_intrinsic(op, integer=False):
        """An intrinsic running `op` (an m16n8 MMA with six b32 operand registers and FP32 C and D, or int32 ones:
        `integer`) on one lane's registers; its inline assembly returns the four D values as a literal struct."""
        @_intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            u, acc = _types.uint32, (_types.int32 if integer else _types.float32)
            sig = _types.UniTuple(acc, 4)(u, u, u, u, u, u, acc, acc, acc, acc)

            def codegen(context, builder, signature, args):
                i32 = _ir.IntType(32)
                el, c = (i32, "r") if integer else (_ir.FloatType(), "f")
                fnty = _ir.FunctionType(_ir.LiteralStructType([el] * 4), [i32] * 6 + [el] * 4)
                asm = _ir.InlineAsm(fnty, op + " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                                    ",".join([f"={c}"] * 4 + ["r"] * 6 + [c] * 4))
                res = builder.call(asm, args)
                vals = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, vals)
            return sig, codegen
        return mma

    _mma_e4m3 = _mma_intrinsic("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")
    _mma_f16 = _mma_intrinsic("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    _mma_bf16 = _mma_intrinsic("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    _mma_int_u8u8 = _mma_intrinsic("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32", integer=True)
    _mma_int_u8s8 = _mma_intrinsic("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32", integer=True)

    @inline_device
    def mma_e4m3_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """m16n8k32 E4M3 x E4M3 + FP32 (module docstring: emulated by ptxas on sm_90); `ex` is unused here."""
        return _mma_e4m3(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0), np.uint32(b1),
                         np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))

    @inline_device
    def mma_f16_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """m16n8k16 f16 x f16 + FP32 on the tensor cores (module docstring); `ex` is unused here."""
        return _mma_f16(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0), np.uint32(b1),
                        np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))

    @inline_device
    def mma_bf16_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """m16n8k16 BF16 x BF16 + FP32 on the tensor cores (module docstring); `ex` is unused here."""
        return _mma_bf16(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0), np.uint32(b1),
                         np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))

    @inline_device
    def mma_u8u8_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """m16n8k32 u8 x u8 + int32 on the tensor cores (module docstring); `ex` is unused here."""
        return _mma_int_u8u8(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0),
                             np.uint32(b1), np.int32(c0), np.int32(c1), np.int32(c2), np.int32(c3))

    @inline_device
    def mma_u8s8_device(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ex):
        """m16n8k32 u8 x s8 + int32 on the tensor cores (module docstring); `ex` is unused here."""
        return _mma_int_u8s8(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0),
                             np.uint32(b1), np.int32(c0), np.int32(c1), np.int32(c2), np.int32(c3))

    @_intrinsic
    def _cvt_e4m3x8_f16x2x4(typingctx, word):
        """Eight E4M3 codes of a b64 -> four f16x2 words: the register split into four 16-bit parts by one mov (no
        shifts: each conversion reads its half of a 32-bit register directly, .H0 / .H1 in the SASS)."""
        sig = _types.UniTuple(_types.uint32, 4)(_types.uint64)

        def codegen(context, builder, signature, args):
            i32 = _ir.IntType(32)
            fnty = _ir.FunctionType(_ir.LiteralStructType([i32] * 4), [_ir.IntType(64)])
            asm = _ir.InlineAsm(fnty, "{ .reg .b16 c0, c1, c2, c3; mov.b64 {c0, c1, c2, c3}, $4; "
                                      "cvt.rn.f16x2.e4m3x2 $0, c0; cvt.rn.f16x2.e4m3x2 $1, c1; "
                                      "cvt.rn.f16x2.e4m3x2 $2, c2; cvt.rn.f16x2.e4m3x2 $3, c3; }",
                                "=r,=r,=r,=r,l")
            res = builder.call(asm, args)
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(res, j) for j in range(4)])
        return sig, codegen

    @_intrinsic
    def _prmt(typingctx, a, b, sel):
        """prmt.b32 d, a, b, sel (default mode)."""
        sig = _types.uint32(_types.uint32, _types.uint32, _types.uint32)

        def codegen(context, builder, signature, args):
            i32 = _ir.IntType(32)
            asm = _ir.InlineAsm(_ir.FunctionType(i32, [i32] * 3), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, args)
        return sig, codegen

    @_intrinsic
    def _ld_v4(typingctx, ary, i):
        """The 16 bytes at element i of a 1-D array of 32-bit elements as one LLVM vector load (align 16), not inline
        assembly: the compiler infers the array's address space, so a shared-memory array gives LDS.128 and a
        global one LDG.E.128 (the inline `ld.v4` this replaced was generic: LD.E.128, two R2UR a load for the
        descriptor, and the generic path's latency on shared memory)."""
        if ary.ndim != 1 or ary.dtype not in (_types.uint32, _types.int32, _types.float32):
            return None
        sig = _types.UniTuple(ary.dtype, 4)(ary, _types.int64)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(arr.data, [args[1]])
            is_f = signature.args[0].dtype == _types.float32
            el = _ir.FloatType() if is_f else _ir.IntType(32)
            vec = builder.load(builder.bitcast(ptr, _ir.VectorType(el, 4).as_pointer()), align=16)
            vals = [builder.extract_element(vec, _ir.Constant(_ir.IntType(32), j)) for j in range(4)]
            return context.make_tuple(builder, signature.return_type, vals)
        return sig, codegen

    @inline_device
    def load4_device(ary, i):
        """ary[i .. i + 3] in one 16-byte load; i a multiple of 4 (and the array 16-byte aligned, as device arrays
        are), in range: nothing is checked."""
        return _ld_v4(ary, np.int64(i))

    @_intrinsic
    def _ld_at(typingctx, ary, i, k):
        """ary[i + k] through two in-bounds element offsets, i then k: with k a constant the compiler keeps the
        address of element i and folds k into the load's immediate offset (numba's own indexing adds i + k first, in
        64 bits, and gives each load its own address arithmetic)."""
        if ary.ndim != 1:
            return None
        sig = ary.dtype(ary, _types.uint64, _types.uint64)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(builder.gep(arr.data, [args[1]], inbounds=True), [args[2]], inbounds=True)
            return builder.load(ptr)
        return sig, codegen

    @inline_device
    def load_at_device(ary, i, k):
        """ary[i + k] for a 1-D array, i and k unsigned, i + k in range (nothing is checked); k a constant folds into
        the load instruction."""
        return _ld_at(ary, np.uint64(i), np.uint64(k))

    @inline_device
    def e4m3x8_to_f16x2_device(word):
        """Eight E4M3 codes (a uint64, element 0 in the low byte) -> four uint32 of two halves each: codes 0-1, 2-3,
        4-5, 6-7 (four hardware conversions, no shifts)."""
        return _cvt_e4m3x8_f16x2x4(np.uint64(word))

    @inline_device
    def byte_perm_device(a, b, sel):
        """prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of the pair (b, a), a's bytes 0-3,
        b's 4-7 (one PRMT; a constant sel is folded into it)."""
        return _prmt(np.uint32(a), np.uint32(b), np.uint32(sel))


@inline_device
def mma_e4m3_f16h_device(a0, a1, a2, a3, b0l, b0h, b1l, b1h, ex):
    """mma_e4m3_f16_device with B given as halves: the codes of b0 and b1 as e4m3x8_to_f16x2_device gives them for
    the word b0 | b1 << 32 (b0's low pair, its high pair, then b1's), e.g. staged so by the caller."""
    a0l, a0h, a1l, a1h = e4m3x8_to_f16x2_device(np.uint64(a0) | (np.uint64(a1) << np.uint64(32)))
    a2l, a2h, a3l, a3h = e4m3x8_to_f16x2_device(np.uint64(a2) | (np.uint64(a3) << np.uint64(32)))
    d0, d1, d2, d3 = mma_f16_device(a0l, a1l, a2l, a3l, b0l, b1l, 0.0, 0.0, 0.0, 0.0, ex)
    return mma_f16_device(a0h, a1h, a2h, a3h, b0h, b1h, d0, d1, d2, d3, ex)


@inline_device
def mma_e4m3_f16_device(a0, a1, a2, a3, b0, b1, ex):
    """The m16n8k32 E4M3 MMA of mma_e4m3_device's fragments with C = 0, as two chained f16 MMAs (module docstring):
    the low code pair of every register first, then the high pair."""
    b0l, b0h, b1l, b1h = e4m3x8_to_f16x2_device(np.uint64(b0) | (np.uint64(b1) << np.uint64(32)))
    return mma_e4m3_f16h_device(a0, a1, a2, a3, b0l, b0h, b1l, b1h, ex)


@cuda.jit(cache=True)
def mma_e4m3_pair_kernel(regs, out):
    """Warp w: its lanes' six fragment registers regs[w, lane] (uint32) -> out[w, 0, lane] = mma_e4m3_device (C = 0)
    and out[w, 1, lane] = mma_e4m3_f16_device, four FP32 each (tests: the chain against the instruction)."""
    grid_entry_device()
    ex = cuda.shared.array((4, WARP, MMA_EX_WORDS), np.uint32)
    lane = cuda.threadIdx.x % WARP
    w = cuda.threadIdx.x // WARP
    b = cuda.blockIdx.x * 4 + w                        # block-uniform guard: every lane of a warp takes the MMAs
    if b < regs.shape[0]:
        r = regs[b, lane]
        d0, d1, d2, d3 = mma_e4m3_device(r[0], r[1], r[2], r[3], r[4], r[5], 0.0, 0.0, 0.0, 0.0, ex[w])
        e0, e1, e2, e3 = mma_e4m3_f16_device(r[0], r[1], r[2], r[3], r[4], r[5], ex[w])
        out[b, 0, lane, 0] = d0
        out[b, 0, lane, 1] = d1
        out[b, 0, lane, 2] = d2
        out[b, 0, lane, 3] = d3
        out[b, 1, lane, 0] = e0
        out[b, 1, lane, 1] = e1
        out[b, 1, lane, 2] = e2
        out[b, 1, lane, 3] = e3


@cuda.jit(cache=True)
def e4m3x8_to_f16_kernel(words, out):
    """out[4i .. 4i + 3] = e4m3x8_to_f16x2_device(words[i]) (tests: the eight-code conversion)."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < words.shape[0]:
        h0, h1, h2, h3 = e4m3x8_to_f16x2_device(words[i])
        out[4 * i] = h0
        out[4 * i + 1] = h1
        out[4 * i + 2] = h2
        out[4 * i + 3] = h3


@cuda.jit(cache=True)
def byte_perm_kernel(a, b, sel, out):
    """out[i] = byte_perm_device(a[i], b[i], sel[i]) (tests)."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < a.shape[0]:
        out[i] = byte_perm_device(a[i], b[i], sel[i])


SIGNATURES = {"e4m3x8_to_f16_kernel": "void(uint64[:], uint32[:])",
              "mma_e4m3_pair_kernel": "void(uint32[:, :, :], float32[:, :, :, :])",
              "byte_perm_kernel": "void(uint32[:], uint32[:], uint32[:], uint32[:])"}
