
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

// FMT 0 q4_0, 1 q4_1, 2 q4_k, 3 q8_0 (folded form only); BT batch tile (<= 32); X_F16: x, y fp16 (else bf16); OUT32: y fp32 (the split-K
// workspace, or an fp32 output); RT row tiles and P phases per block; U loads in flight per warp; GMAX groups
// per split at most.
#define KW (RT * P)
#define NB ((BT + 7) / 8)                       /* the mma's 8-column blocks per tile */
#define NRAW (FMT == 2 ? 3 : FMT == 1 ? 2 : 1)   /* per row: q4_0 {d}; q4_1 {d, m}; q4_k {d, dmin, sc | mn << 8} */
#define XROW (GMAX * 16 + 16)                   /* u32 words per staged x row (+16: LDS.128 without conflicts) */
#define XR (BT % 8 ? BT + 1 : BT)               /* staged rows: BT, and a row of zeros for the mma's spare columns */
// blocks per SM the registers must allow: up to 8 sequences and a ring of up to 4 groups, 56 registers a thread
// (1792 a warp: ~36 warps of weight loads in flight per SM; unbounded, NVRTC took 63); otherwise MINB (the
// launch's MINB16 for tiles of 16+, the folded form's MINB for smaller ones: 1 leaves the compiler free)
#define MIN_BLOCKS (!FOLD && BT <= 8 && U <= 4 ? (65536 / 1792) / KW : MINB)
// dynamic shared memory, in this order (kernels/int4_mma.py's smem_bytes is the same sum)
#define XS_BYTES (XR * XROW * 4)                                 /* xs[XR][XROW] */
#define XSUMS ((FMT == 1 || FMT == 2) && !FOLD)  /* the min term needs x's group sums (not when folded) */
#if FMT == 3 && !FOLD
#error "q8_0 has the folded form only"
#endif
#define XP_BYTES (XSUMS ? (BT * 4 + XR) * GMAX * 4 : 0)          /* xpart[BT][GMAX][4], xsum[XR][GMAX] */
#define SMEM_TOTAL (XS_BYTES + XP_BYTES + (P - 1) * RT * 32 * MT * 4 * NB * 4)   /* + red[P - 1][RT][32][MT * 4 * NB] */

#ifndef ONEPASS_HOST_EMU
__device__ __forceinline__ float h2f(u16 v) {
    float f; asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v)); return f;
}
__device__ __forceinline__ u16 f32_to_x(float f) {
    u16 r;
#if X_F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}
__device__ __forceinline__ float x_to_f32(u32 v16) {
#if X_F16
    return h2f((u16)v16);
#else
    return __int_as_float(v16 << 16);
#endif
}
__device__ __forceinline__ u32 ld_word(const u32* p) {       // weights: read once, keep L1 for x
    u32 r; asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r; asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p)); return r;
}
// 16 bytes global -> shared, asynchronously (bytes = 0: zero fill, nothing read)
__device__ __forceinline__ void cp_async16_s(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ uint4 ld_w16(const uint4* p) {   // weights, 16 bytes: read once, keep L1 for x
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint4 ld_x16(const uint4* p) {
    uint4 r; asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel)); return r;
}
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 r; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {   // packed 16-bit a * b + c (exact here)
    u32 r;
#if X_F16
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
#endif
    return r;
}
// f rounded to x's dtype, in both halves of a packed pair
__device__ __forceinline__ u32 pack2(float f) {
    u32 r;
#if X_F16
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(f));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(f));
#endif
    return r;
}
// D = A (16 x 16, row) * B (16 x 8, col) + C, fp32 accumulation
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if X_F16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
#endif
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// the 16-bit pattern whose value is 2^7 (bf16) or 2^10 (fp16) with the unit in the low 4 bits; the fma's
// addend takes that power (and q4_0's 8) back off
#if X_F16
#define MAGIC 0x64006400u
#define ONE2 0x3C003C00u
#define NEGOFF (FMT == 0 ? 0xE408E408u : 0xE400E400u)   /* -(1024 + 8), -1024 */
#else
#define MAGIC 0x43004300u
#define ONE2 0x3F803F80u
#define NEGOFF (FMT == 0 ? 0xC308C308u : 0xC300C300u)   /* -(128 + 8), -128 */
#endif

// nibbles s and s + 4 of w as a packed pair of exact integers (q4_0: q - 8)
#if X_F16
// fp16's 10-bit mantissa also holds a nibble at bits 4-7 of a half (its unit then 16, taken off by the fma's 1/16):
// one shift per word (w >> 8, shared by s = 2, 3) instead of bf16's three; the same integers, so the same bits.
// H200 probe at 4060f6f (int4_gemm's method, fp16 x, the folded form, us at B = 1 this / three shifts): 5120x17408
// Q4_0 18.01 / 18.20, 34816x5120 Q4_K 36.77 / 37.93, 5120x17408 Q4_K 20.31 / 20.80 (SASS per quad: 285 / 315, 692 / 753)
#define SIXTEENTH2 0x2C002C00u
#define NEGOFF_HI (FMT == 0 ? 0xD480D480u : 0xD400D400u)   /* -(64 + 8), -64 */
__device__ __forceinline__ u32 nib_pair(u32 w, int s) {
    const u32 v = s >= 2 ? w >> 8 : w;
    return (s & 1) ? fma2(and_or(v, 0x00F000F0u, MAGIC), SIXTEENTH2, NEGOFF_HI)
                   : fma2(and_or(v, 0x000F000Fu, MAGIC), ONE2, NEGOFF);
}
#else
__device__ __forceinline__ u32 nib_pair(u32 w, int s) {
    return fma2(and_or(s == 0 ? w : w >> (4 * s), 0x000F000Fu, MAGIC), ONE2, NEGOFF);
}
#endif

struct Slot {                  // one group's loads for the lane's two rows (g, g + 8)
    u32 wa, wb;                // word t of each row's record
    u32 ra[NRAW], rb[NRAW];    // raw scale bits per row
};

// Where the lane's next group comes from: row a's word t and raw bits, stepped by P groups per load. Row b is
// 8 rows on: a constant offset when N16 (N % 16 == 0, every model shape), else its own pointers (rows past N
// re-read row N - 1). q4_k's d and dmin are per super-block: s, m point at row a's column and g picks the row.
struct Cursor {
    const u32* w;
    const u16 *s, *m, *u;      // q4_0 {d}; q4_1 {d, m}; q4_k {d, dmin, sub (sc | mn << 8)}
#if !N16
    const u32* wb;
    const u16 *sb, *mb, *ub;
#endif
    int g;
};
#if N16
#define ROW_B(c, f, rows) ((c).f + 8 * (rows))
#else
#define ROW_B(c, f, rows) ((c).f##b)
#endif

__device__ __forceinline__ void load_slot(Slot& sl, Cursor& c, int N) {
    const int step = P * N;
    sl.wa = ld_word(c.w);
    sl.wb = ld_word(ROW_B(c, w, 4));
    c.w += step * 4;
#if !N16
    c.wb += step * 4;
#endif
#if FMT == 2
    const int so = (c.g >> 3) * N;
    sl.ra[0] = c.s[so]; sl.rb[0] = ROW_B(c, s, 1)[so];
    sl.ra[1] = c.m[so]; sl.rb[1] = ROW_B(c, m, 1)[so];
    sl.ra[2] = c.u[0]; sl.rb[2] = ROW_B(c, u, 1)[0];
    c.u += step;
#if !N16
    c.ub += step;
#endif
#else
    sl.ra[0] = c.s[0]; sl.rb[0] = ROW_B(c, s, 1)[0];
    c.s += step;
#if !N16
    c.sb += step;
#endif
#if FMT == 1
    sl.ra[1] = c.m[0]; sl.rb[1] = ROW_B(c, m, 1)[0];
    c.m += step;
#if !N16
    c.mb += step;
#endif
#endif
#endif
    c.g += P;
}

// a byte of r (sel 0x7440: byte 0, 0x7441: byte 1) as a float, exactly: one prmt puts it under the exponent of
// 2^23 (where its unit is 1), one fadd takes 2^23 off (an I2F is a quarter-rate instruction)
__device__ __forceinline__ float byte_f32(u32 r, u32 sel) {
    return __int_as_float(prmt(r, 0x4B000000u, sel)) - 8388608.0f;
}

// the group's scale (and for q4_1 / q4_k its min term's factor) from one row's raw bits, in fp32 (exact)
__device__ __forceinline__ float slot_scale(const u32 (&r)[NRAW]) {
#if FMT == 2
    return h2f((u16)r[0]) * byte_f32(r[2], 0x7440u);
#else
    return h2f((u16)r[0]);
#endif
}
__device__ __forceinline__ float slot_min(const u32 (&r)[NRAW]) {
#if FMT == 2
    return -(h2f((u16)r[1]) * byte_f32(r[2], 0x7441u));
#elif FMT == 1
    return h2f((u16)r[1]);
#else
    return 0.0f;
#endif
}

// one group: per 8-column block c, two mmas on exact integers (x from the staged row xr[c], this lane's 16 bytes
// of group gi; the zero row where the lane's column is past the tile), then the group's scale and, q4_1 / q4_k,
// its min term (sums xs2[.][gi] of the lane's two columns, the zero row's past the tile) in fp32.
__device__ __forceinline__ void apply_slot(float (&acc)[MT][4 * NB], const Slot& sl, const u32* const (&xr)[NB],
                                           const float* const (&xs2)[2 * NB], int gi, int t) {
    u32 a_lo[4], a_hi[4];
    a_lo[0] = nib_pair(sl.wa, 0); a_lo[1] = nib_pair(sl.wb, 0);
    a_lo[2] = nib_pair(sl.wa, 1); a_lo[3] = nib_pair(sl.wb, 1);
    a_hi[0] = nib_pair(sl.wa, 2); a_hi[1] = nib_pair(sl.wb, 2);
    a_hi[2] = nib_pair(sl.wa, 3); a_hi[3] = nib_pair(sl.wb, 3);
    const float sa = slot_scale(sl.ra), sb = slot_scale(sl.rb);
#if FMT != 0
    const float ca = slot_min(sl.ra), cb = slot_min(sl.rb);
#endif
#pragma unroll
    for (int c = 0; c < NB; ++c) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xr[c] + (gi * 4 + t) * 4);
        const u32 b_lo[2] = {xv.x, xv.y}, b_hi[2] = {xv.z, xv.w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma16816(d, a_lo, b_lo);
        mma16816(d, a_hi, b_hi);
        float* ac = acc[0] + 4 * c;
        ac[0] = __fmaf_rn(sa, d[0], ac[0]);
        ac[1] = __fmaf_rn(sa, d[1], ac[1]);
        ac[2] = __fmaf_rn(sb, d[2], ac[2]);
        ac[3] = __fmaf_rn(sb, d[3], ac[3]);
#if FMT != 0
        const float x0 = xs2[2 * c][gi], x1 = xs2[2 * c + 1][gi];
        ac[0] = __fmaf_rn(ca, x0, ac[0]);
        ac[1] = __fmaf_rn(ca, x1, ac[1]);
        ac[2] = __fmaf_rn(cb, x0, ac[2]);
        ac[3] = __fmaf_rn(cb, x1, ac[3]);
#endif
    }
}

// 8 staged x values of one word, k = 8w + 0..7 as pairs (0,1) (2,3) (4,5) (6,7) -> (0,4) (1,5) (2,6) (3,7): the pairs
// nib_pair makes of the weights
__device__ __forceinline__ uint4 pair_order(const uint4 v) {
    return make_uint4(prmt(v.x, v.z, 0x5410u), prmt(v.x, v.z, 0x7632u), prmt(v.y, v.w, 0x5410u),
                      prmt(v.y, v.w, 0x7632u));
}

#if FOLD
// The folded form works on quads of 4 consecutive groups: lane (g, t) owns group 4j + t of quad j, all 16 bytes of
// its record for rows g and g + 8 (one 16-byte load each), and its scale and offset. The quad's four words p = 0..3
// feed four mma pairs; in pair p every lane gives word p of its own group, so an mma's k range spans the quad's 4
// groups (x is staged in that order) -- possible because the scales are applied to the weights before the mma.
// Per group that is a quarter of the loads and of the scale work of the exact form.
struct QSlot {                 // one quad's loads for the lane's group: rows (g, g + 8) of each of the MT tiles
    uint4 wa[MT], wb[MT];
#if FMT == 3
    uint4 wa2[MT], wb2[MT];    // q8_0: a group's record is 32 bytes, weights 16..31 here
#endif
    u32 ra[MT][NRAW], rb[MT][NRAW];
};
// Where a quad's instructions go (nvcc 13.0 offline, sm_90, at 660af4f; the B = 1 launches of MEASURED_FOLD): the
// loop over one quad of 5120x17408 Q4_0 (MT 2: 16 words) issues 315, of them LOP3 64, HFMA2 64, HMUL2 64 and SHF 49
// (the nibbles: 77%), HMMA 16, LDG 8, LDS 4, and ~30 of address arithmetic (64-bit products and shifts per load);
// 34816x5120 Q4_K 753. Keeping each lane's record index as a running 32-bit count (one wide multiply-add per load)
// cut that to 312 and 729, and raised 5120x17408 Q4_K from 405 to 411 (constants reloaded under its register cap):
// 1-3% at most of an issue-bound loop, not kept.
struct QCursor {               // the lane's next group; in tile m row b is db[m] rows after row a (8, or fewer past N)
    const uint4* w;
    const u16 *s, *m, *u;
    int na[MT], db[MT], g;
};

__device__ __forceinline__ void load_quad(QSlot& sl, QCursor& c, int N, int g_end) {
    const int g = min(c.g, g_end - 1);          // past the split (its last quad): a valid group, whose x is zero
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const i64 e = (i64)g * N + c.na[mt];
        const int db = c.db[mt];
#if FMT == 3
        sl.wa[mt] = ld_w16(c.w + 2 * e); sl.wa2[mt] = ld_w16(c.w + 2 * e + 1);
        sl.wb[mt] = ld_w16(c.w + 2 * (e + db)); sl.wb2[mt] = ld_w16(c.w + 2 * (e + db) + 1);
#else
        sl.wa[mt] = ld_w16(c.w + e);
        sl.wb[mt] = ld_w16(c.w + e + db);
#endif
#if FMT == 2
        const i64 so = (i64)(g >> 3) * N + c.na[mt];
        sl.ra[mt][0] = c.s[so]; sl.rb[mt][0] = c.s[so + db];
        sl.ra[mt][1] = c.m[so]; sl.rb[mt][1] = c.m[so + db];
        sl.ra[mt][2] = c.u[e]; sl.rb[mt][2] = c.u[e + db];
#else
        sl.ra[mt][0] = c.s[e]; sl.rb[mt][0] = c.s[e + db];
#if FMT == 1
        sl.ra[mt][1] = c.m[e]; sl.rb[mt][1] = c.m[e + db];
#endif
#endif
    }
    c.g += 4 * P;
}

// a quad's scale and offset per row, rounded to x's dtype and packed in pairs (q4_0: -0, so q * s rounds once)
struct QScales { u32 sa[MT], sb[MT], ca[MT], cb[MT]; };
__device__ __forceinline__ QScales quad_scales(const QSlot& sl) {
    QScales q;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#if defined(READY_SCALES) && READY_SCALES
        // int4_wgmma_ws's ready words (scale | offset << 16), already rounded: each half into both halves of a pair
        q.sa[mt] = prmt(sl.ra[mt][0], 0u, 0x1010u); q.sb[mt] = prmt(sl.rb[mt][0], 0u, 0x1010u);
        q.ca[mt] = prmt(sl.ra[mt][0], 0u, 0x3232u); q.cb[mt] = prmt(sl.rb[mt][0], 0u, 0x3232u);
#else
        q.sa[mt] = pack2(slot_scale(sl.ra[mt])); q.sb[mt] = pack2(slot_scale(sl.rb[mt]));
#if FMT != 0
        q.ca[mt] = pack2(slot_min(sl.ra[mt])); q.cb[mt] = pack2(slot_min(sl.rb[mt]));
#else
        q.ca[mt] = 0x80008000u; q.cb[mt] = 0x80008000u;
#endif
#endif
    }
    return q;
}
#if FMT == 3
// q8_0: weights s and s + 4 of 8p..8p+7 (byte s of words 2p and 2p + 1) as a packed pair of exact integers, the same
// pairs nib_pair makes of a 4-bit word, so x is staged alike. A byte's low 7 bits r go under MAGIC (128 + r, or
// 1024 + r in fp16) and its sign bit into the addend: -128 or -256 (-1024 or -1152), so the fma leaves r - 128 h = q.
__device__ __forceinline__ u32 byte_pair(u32 lo, u32 hi, int s) {
    const u32 v = prmt(lo, hi, (u32)(s | s << 4 | (4 + s) << 8 | (4 + s) << 12));   // byte s of lo, of hi: one a half
    return fma2(and_or(v, 0x007F007Fu, MAGIC), ONE2, and_or(v, 0x00800080u, MAGIC | 0x80008000u));
}
#define WEIGHT_PAIR(w, w2, s) byte_pair(w, w2, s)
#else
#define WEIGHT_PAIR(w, w2, s) nib_pair(w, s)
#endif
// word p of the lane's group (q8_0: words 2p, 2p + 1) as the A fragment of k16 step 2p + h (mma.m16n8k16's layout,
// which is also a warp's part of wgmma's m64 A): the weights q * s + c, one packed fma per pair; h = 0 takes pairs
// (0,4) (1,5), h = 1 (2,6) (3,7)
__device__ __forceinline__ void quad_half(const QSlot& sl, const QScales& q, int p, int mt, int h, u32 (&a)[4]) {
#if FMT == 3
    const uint4 va = p < 2 ? sl.wa[mt] : sl.wa2[mt], vb = p < 2 ? sl.wb[mt] : sl.wb2[mt];
    const u32 wa = p & 1 ? va.z : va.x, wa2 = p & 1 ? va.w : va.y;
    const u32 wb = p & 1 ? vb.z : vb.x, wb2 = p & 1 ? vb.w : vb.y;
#else
    const u32 wa = p == 0 ? sl.wa[mt].x : p == 1 ? sl.wa[mt].y : p == 2 ? sl.wa[mt].z : sl.wa[mt].w;
    const u32 wb = p == 0 ? sl.wb[mt].x : p == 1 ? sl.wb[mt].y : p == 2 ? sl.wb[mt].z : sl.wb[mt].w;
#endif
    a[0] = fma2(WEIGHT_PAIR(wa, wa2, 2 * h), q.sa[mt], q.ca[mt]); a[1] = fma2(WEIGHT_PAIR(wb, wb2, 2 * h), q.sb[mt], q.cb[mt]);
    a[2] = fma2(WEIGHT_PAIR(wa, wa2, 2 * h + 1), q.sa[mt], q.ca[mt]);
    a[3] = fma2(WEIGHT_PAIR(wb, wb2, 2 * h + 1), q.sb[mt], q.cb[mt]);
}
// both k16 steps of word p
__device__ __forceinline__ void quad_word(const QSlot& sl, const QScales& q, int p, int mt, u32 (&a_lo)[4],
                                          u32 (&a_hi)[4]) {
    quad_half(sl, q, p, mt, 0, a_lo);
    quad_half(sl, q, p, mt, 1, a_hi);
}
#endif
