// The decode planner's device queries (launch.cu), defined for host-only test drivers of
// kernels/csrc/decode_plan.cu that never call them: they only need to link
// (decode_plan_main.cu, decode_stage_module.cpp). Include it in one translation unit.
#pragma once

#include "decode_plan.h"

namespace kvpager {
bool decode_instance_built(DType, DType, int, int, int, int) { return true; }
int decode_merge_smem(DType, DType, int, int, int, int) { return 0; }
double device_memory_bandwidth(int) { return 0; }
int decode_blocks_per_sm(DType, DType, int, int, int, int, int) { return 1; }
int device_sm_count(int) { return 1; }
}  // namespace kvpager
