#pragma once
/// Instruction-set paths of the CPU kernels. Each path is deterministic on its own (batch 1
/// and batch N, any thread count give the same bits); different paths may differ in the last
/// bits because their accumulation widths differ.
#include <cstdint>
#include <string_view>

namespace tandem {

enum class cpu_isa : uint8_t {
  best = 0,  ///< the widest vector path this CPU runs (detected once; never amx)
  scalar,    ///< portable C++, 8-lane accumulation order
  avx2,      ///< AVX2 + FMA + F16C, 8 lanes
  avx512,    ///< AVX-512F, 16 lanes
  amx,       ///< avx512, with f16 and bf16 matmuls on AMX tiles (kernels/cpu/amx.h)
};

namespace cpu {

/// Every kernel path by name, `best` first (parse_isa's names, check-config's choices).
inline constexpr cpu_isa all_isas[] = {cpu_isa::best, cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512,
                                       cpu_isa::amx};

/// The path `best` resolves to on this CPU.
cpu_isa detected_isa();
/// Whether this CPU can run `i` (`best` and `scalar` always).
bool isa_supported(cpu_isa i);
/// `best` -> detected_isa(); an unsupported path throws tandem::error naming the ones available.
cpu_isa resolve_isa(cpu_isa i);
/// The path of everything but the f16/bf16 matmul: amx -> avx512, the others unchanged.
constexpr cpu_isa vector_isa(cpu_isa i) { return i == cpu_isa::amx ? cpu_isa::avx512 : i; }
/// "scalar", "avx2", "avx512", "amx", "best".
std::string_view to_string(cpu_isa i);
/// Parses the names above; throws tandem::error listing them.
cpu_isa parse_isa(std::string_view s);

}  // namespace cpu
}  // namespace tandem
