// A host-only driver of kernels/csrc/decode_plan.cu's work-list planner, for a CPU test that
// compares it with kernels/decode_plan.py (tests/unit/test_decode_plan_cpp.py). Reads cases from
// stdin, "rows workers longest_item capacity min_item item_cost" then the rows' context lengths;
// prints per case the planner's return value, then its plan's ints when it planned (>= 0).
// With --time N: prints per case the best of N calls' microseconds instead (benchmarks/host_planner.py).
// The planner's device queries are not called here (decode_plan_host_stubs.h).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "decode_plan_host_stubs.h"

int main(int argc, char** argv) {
  const int reps = argc == 3 && std::strcmp(argv[1], "--time") == 0 ? std::atoi(argv[2]) : 0;
  int rows, workers, longest, capacity, min_item, item_cost;
  while (std::scanf("%d %d %d %d %d %d", &rows, &workers, &longest, &capacity, &min_item, &item_cost) == 6) {
    std::vector<int32_t> lens(rows);
    for (auto& x : lens)
      if (std::scanf("%d", &x) != 1) return 2;
    std::vector<int32_t> out(kvpager::work_list_ints(capacity, rows), -12345);
    if (reps > 0) {
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        const auto start = std::chrono::steady_clock::now();
        kvpager::plan_decode_work(lens.data(), rows, workers, longest, capacity, min_item, item_cost, out.data());
        const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - start;
        best = spent.count() < best ? spent.count() : best;
      }
      std::printf("%.2f\n", best);
      continue;
    }
    const int n = kvpager::plan_decode_work(lens.data(), rows, workers, longest, capacity, min_item, item_cost, out.data());
    std::printf("%d", n);
    if (n >= 0)
      for (int v : out) std::printf(" %d", v);
    std::printf("\n");
  }
  return 0;
}
