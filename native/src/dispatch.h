// CPU feature detection (cpuid + xgetbv, read once) and the choice of kernel table.
#pragma once
#include <string>
#include <vector>

#include "tandem/kernels.h"

namespace tandem {

// Variants this build holds that this CPU can run, best last.
std::vector<std::string> supported_isas();
// The table for a named variant; throws std::invalid_argument if unknown or unsupported here.
const KernelTable& kernels_for(const std::string& isa);
// The active variant: the best supported one, or `forced` (e.g. from TANDEM_NATIVE_ISA) when set.
const KernelTable& select_kernels(const std::string& forced);

}  // namespace tandem
