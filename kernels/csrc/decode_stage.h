// A CUDA-graph decode step's integer inputs written straight from the step's Python objects (the
// lists of a Step reply, the int32 array of its packed tables) into the pinned buffer that goes
// to the device in one copy, the step's work list planned in place. The layout is
// worker/decode_graphs.py's ``_Inputs``. Each row is one C-level conversion with no temporary
// array: numpy's ``view[:s] = list`` builds and discards an array per field, and at small
// batches those conversions were most of a graph step's host cost.
//
// CPython API and C++ only (no torch, no CUDA calls): decode_stage_binding.cpp wraps it with the
// device copies; tests/unit/test_decode_stage_cpp.py builds it with nvcc on a CPU machine.
#pragma once

#include <Python.h>

#include <cstdint>

namespace kvpager {

// Byte offsets of one batch bucket's inputs in the buffer (decode_graphs.py _Inputs).
struct DecodeStageLayout {
  int64_t batch;       // the bucket's rows: int64 [4, batch] at 0 (tokens, positions, slots, feedback rows)
  int64_t context_at;  // int32 [batch] context lengths
  int64_t work_at;     // int32 work list (decode_plan.h layout), up to work_end
  int64_t work_end;
  int64_t tables_at;   // int32 block tables, rows `table_stride` apart
};

// The work-list geometry the graphs were captured with; workers == 0: the graphs take no work list.
struct DecodeStagePlanner {
  int workers, longest_item, min_item, item_cost;
};

// Writes a step of `rows` rows (1 <= rows <= lay.batch) into `host` (`host_bytes` long):
//   longs[0..2][:rows] = tokens, positions, slots; longs[3][:rows] = feedback_rows, or -1 where
//   feedback_rows is Py_None; the padding rows [rows, batch) get token 0, position 0, slot -1,
//   feedback -1 and context 0;
//   context[:rows] = context_lens;
//   with a planner, the work list planned over all `batch` context lengths, its header's int 2
//   set to `table_stride` (the kernels' table row stride);
//   the table's `rows` x `width` entries (`tables` row-major, flat) in rows `table_stride` apart.
// Each sequence argument is a list or tuple of ints, or a C-contiguous buffer of int32/int64
// (a numpy array). Returns the bytes to copy from the buffer's start (tables_at + 4 * rows *
// table_stride). Throws std::invalid_argument, naming the field, for a wrong length, a non-integer,
// a value outside its slot's type, a buffer too small or a step the planner refuses; whatever it
// wrote by then is garbage (the caller copies nothing). O(batch + rows * width) plus the planner's
// O(batch log batch + items).
int64_t stage_decode_inputs(uint8_t* host, int64_t host_bytes, const DecodeStageLayout& lay,
                            const DecodeStagePlanner& planner, int64_t rows, PyObject* tokens, PyObject* positions,
                            PyObject* slots, PyObject* feedback_rows, PyObject* context_lens, PyObject* tables,
                            int64_t width, int64_t table_stride);

}  // namespace kvpager
