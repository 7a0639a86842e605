// Checking the best variant against generic before its first use (selfcheck.cpp).
#pragma once
#include <string>

#include "tandem/kernels.h"

namespace tandem {

// The best supported variant that agrees with generic on a small layer of every format; each one
// passed over adds a sentence to `warning`. `faulty` names a variant to treat as wrong (tests).
const KernelTable& checked_kernels(const std::string& faulty, std::string& warning);

}  // namespace tandem
