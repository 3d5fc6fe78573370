// A CPython module over kernels/csrc/decode_stage.cpp (no torch, no CUDA device), for the CPU test
// that compares its fills with the numpy ones they replaced (tests/unit/test_decode_stage_cpp.py):
//   stage(buffer, (batch, context_at, work_at, work_end, tables_at), (workers, longest_item,
//         min_item, item_cost), rows, tokens, positions, slots, feedback_rows, context_lens,
//         tables, width, table_stride) -> bytes to copy
// with `buffer` a writable bytes-like object (a numpy uint8 array). The planner's device queries
// are not called here (decode_plan_host_stubs.h).
#include <Python.h>

#include <stdexcept>

#include "decode_plan_host_stubs.h"
#include "decode_stage.h"

static PyObject* stage(PyObject*, PyObject* args) {
  Py_buffer buffer;
  kvpager::DecodeStageLayout lay{};
  kvpager::DecodeStagePlanner planner{};
  long long rows, width, stride;
  PyObject *tokens, *positions, *slots, *feedback, *context, *tables;
  if (!PyArg_ParseTuple(args, "w*(LLLLL)(iiii)LOOOOOOLL", &buffer, &lay.batch, &lay.context_at, &lay.work_at,
                        &lay.work_end, &lay.tables_at, &planner.workers, &planner.longest_item, &planner.min_item,
                        &planner.item_cost, &rows, &tokens, &positions, &slots, &feedback, &context, &tables,
                        &width, &stride))
    return nullptr;
  int64_t end = -1;
  try {
    end = kvpager::stage_decode_inputs(static_cast<uint8_t*>(buffer.buf), buffer.len, lay, planner, rows, tokens,
                                       positions, slots, feedback, context, tables, width, stride);
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  }
  PyBuffer_Release(&buffer);
  return end < 0 ? nullptr : PyLong_FromLongLong(end);
}

static PyMethodDef methods[] = {{"stage", stage, METH_VARARGS, "decode_stage.h stage_decode_inputs"},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "decode_stage_test", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_decode_stage_test() { return PyModule_Create(&module); }
