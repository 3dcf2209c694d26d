// AMX bf16 tiles for the blocked GEMM (kernels/csrc/gemv.cpp) at batch-sized row counts.
//
// Why: past ~8 rows the blocked kernel's vdpbf16ps runs out of instructions (0.42x oneDNN's speed at 32 rows), and
// oneDNN's own AMX GEMM streams SmolLM2's bf16 weights at ~60% of the read bandwidth at 32 rows (~17 of a ~35 ms
// batch-32 step): small-M calls pay its per-call setup and its packing of the activations. The weight's bf16
// blocked layout (kernels/gemv.py: tile t holds, for each k pair p, the 16 rows' (W[r, 2p], W[r, 2p + 1]) in one
// 64-byte row) is already TDPBF16PS's B-tile layout, so 16 k pairs of a tile are one contiguous 1 KiB load; a
// pass multiplies up to 32 activation rows (two A tiles) by two weight tiles into four fp32 C tiles.
//
// TDPBF16PS adds each k pair's two exact products into the fp32 sum in k order, as vdpbf16ps does, so its sums
// are those of the blocked vdpbf16ps kernel in every case tested (tests/test_gemv.py compares them).
#include <c10/util/BFloat16.h>

#include <cstdint>

// AMX intrinsics under target attributes: GCC 11 and clang 12 on; an older compiler builds the stubs below (the
// kernel then never picks AMX) instead of failing the whole extension.
#if defined(__x86_64__) && defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                                                  (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DEEPINFER_AMX 1
#define DEEPINFER_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace deepinfer {

// CPUID says AMX-TILE and AMX-BF16, and Linux lets this process use the tile state (it must be asked once:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); oneDNN asks too).
bool amx_bf16_usable() {
#if defined(DEEPINFER_AMX) && defined(SYS_arch_prctl)
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

#if defined(DEEPINFER_AMX)
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (row block 0 x tile 0, 0 x 1, 1 x 0, 1 x 1); tmm4-5: A (row blocks); tmm6-7: B (the two tiles).
template <int kRowBlocks>
DEEPINFER_AMX_TARGET void tile_pair(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w0,
                                    const c10::BFloat16* w1, int64_t in, float* acc) {
  constexpr int64_t kPrefetchPairs = 64;  // 4 KiB ahead in each weight stream
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kRowBlocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * int64_t(sizeof(c10::BFloat16));
  for (int64_t k = 0; k < in; k += 32) {
    const c10::BFloat16* b0 = w0 + k * 16;  // k / 2 pairs of 32 bf16
    const c10::BFloat16* b1 = w1 + k * 16;
    for (int line = 0; line < 16; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(b0 + (kPrefetchPairs + line) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + (kPrefetchPairs + line) * 32), _MM_HINT_T0);
    }
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_loadd(4, x + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowBlocks == 2) {
      _tile_loadd(5, x + 16 * ldx + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kAccStride = 32 * sizeof(float);
  _tile_stored(0, acc, kAccStride);
  _tile_stored(1, acc + 16, kAccStride);
  if constexpr (kRowBlocks == 2) {
    _tile_stored(2, acc + 16 * 32, kAccStride);
    _tile_stored(3, acc + 16 * 32 + 16, kAccStride);
  }
}

}  // namespace

DEEPINFER_AMX_TARGET void amx_configure_thread() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  // GCC 12 does not count ldtilecfg as a read of the configuration and drops the stores above (-O3): a barrier.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

DEEPINFER_AMX_TARGET void amx_release_thread() { _tile_release(); }

void amx_tile_pair(const c10::BFloat16* x, int64_t ldx, int row_blocks, const c10::BFloat16* w0,
                   const c10::BFloat16* w1, int64_t in, float* acc) {
  if (row_blocks == 2) {
    tile_pair<2>(x, ldx, w0, w1, in, acc);
  } else {
    tile_pair<1>(x, ldx, w0, w1, in, acc);
  }
}
#else
void amx_configure_thread() {}
void amx_release_thread() {}
void amx_tile_pair(const c10::BFloat16*, int64_t, int, const c10::BFloat16*, const c10::BFloat16*, int64_t, float*) {}
#endif

}  // namespace deepinfer
