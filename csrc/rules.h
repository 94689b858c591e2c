// Unmasking rules, exactly sangam/decoding/rules.py's select_commits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace sangam {

enum class Rule { kThreshold, kFactor, kTopk, kUnknown };

// rank_candidates' order: confidence descending, ties to the earlier position. NaN is outside
// the contract (the scorer never yields it); ranking it as -inf keeps the order total, which
// std::sort needs to stay memory-safe.
inline bool ranks_before(const double* conf, int64_t i, int64_t j) {
  const double lo = -std::numeric_limits<double>::infinity();
  const double a = std::isnan(conf[i]) ? lo : conf[i];
  const double b = std::isnan(conf[j]) ? lo : conf[j];
  return a > b || (a == b && i < j);
}

// Marks in chosen[0, n) the candidates to commit (candidates in position order); none when
// n == 0. `order` is scratch space, kept by the caller across calls to avoid reallocating.
inline void select_commits(const double* conf, int64_t n, Rule rule, double threshold,
                           double factor, int64_t tokens_per_step, std::vector<int64_t>& order,
                           uint8_t* chosen) {
  std::fill(chosen, chosen + n, uint8_t{0});
  if (n == 0) return;
  if (rule == Rule::kThreshold) {
    // Every candidate at or above the threshold; else the single most confident one. No sort:
    // the set is the same whichever order it is found in.
    bool any = false;
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (conf[i] >= threshold) {
        chosen[i] = 1;
        any = true;
      }
      if (ranks_before(conf, i, best)) best = i;
    }
    if (!any) chosen[best] = 1;
    return;
  }
  order.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  const auto cmp = [conf](int64_t i, int64_t j) { return ranks_before(conf, i, j); };
  int64_t take;
  if (rule == Rule::kFactor) {
    std::sort(order.begin(), order.end(), cmp);
    // The longest sorted prefix whose k-th member (k >= 2, 1-based) has c >= 1 - f / (k + 1).
    take = 1;
    while (take < n && conf[order[static_cast<size_t>(take)]] >=
                           1.0 - factor / static_cast<double>(take + 2)) {
      ++take;
    }
  } else {  // top-k (callers reject unknown rules before selecting)
    // SamplingParams keeps tokens_per_step >= 1; the clamp only keeps the sort in bounds.
    take = std::clamp<int64_t>(tokens_per_step, 0, n);
    std::partial_sort(order.begin(), order.begin() + take, order.end(), cmp);
  }
  for (int64_t i = 0; i < take; ++i) chosen[order[static_cast<size_t>(i)]] = 1;
}

}  // namespace sangam
