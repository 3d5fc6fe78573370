// See decode_stage.h.
#include "decode_stage.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "decode_plan.h"

namespace kvpager {
namespace {

[[noreturn]] void refuse(const char* name, const std::string& what) {
  throw std::invalid_argument(std::string(name) + ": " + what);
}

// A Python sequence of integers, read in place: a list's or tuple's items, or the elements of a
// C-contiguous int32/int64 buffer; any other sequence is converted to a list once.
class IntSource {
 public:
  IntSource(PyObject* obj, int64_t expected, const char* name) : name_(name) {
    if (!PyList_Check(obj) && !PyTuple_Check(obj) && PyObject_CheckBuffer(obj)) {
      if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        if (int_buffer(view_)) {
          itemsize_ = static_cast<int>(view_.itemsize);
          check_length(view_.len / view_.itemsize, expected);   // releases the view when it throws
          return;
        }
        PyBuffer_Release(&view_);   // another element type: read it as a sequence below
      } else {
        PyErr_Clear();
      }
    }
    items_ = PySequence_Fast(obj, "");
    if (items_ == nullptr) {
      PyErr_Clear();
      refuse(name_, std::string("expected a sequence of ints, got ") + Py_TYPE(obj)->tp_name);
    }
    check_length(PySequence_Fast_GET_SIZE(items_), expected);
  }
  ~IntSource() { release(); }
  IntSource(const IntSource&) = delete;
  IntSource& operator=(const IntSource&) = delete;

  // Elements [begin, begin + n) into dst, each checked to fit T.
  template <typename T>
  void copy(T* dst, int64_t begin, int64_t n) const {
    if (items_ == nullptr) {
      if (itemsize_ == static_cast<int>(sizeof(T))) {
        std::memcpy(dst, static_cast<const T*>(view_.buf) + begin, n * sizeof(T));
      } else if (itemsize_ == 4) {
        const int32_t* src = static_cast<const int32_t*>(view_.buf) + begin;
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
      } else {
        const int64_t* src = static_cast<const int64_t*>(view_.buf) + begin;
        for (int64_t i = 0; i < n; ++i) dst[i] = checked<T>(src[i], begin + i);
      }
      return;
    }
    PyObject** items = PySequence_Fast_ITEMS(items_) + begin;
    for (int64_t i = 0; i < n; ++i) {
      const long long v = PyLong_AsLongLong(items[i]);
      if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        refuse(name_, "entry " + std::to_string(begin + i) + " is not an integer within int64 (a " +
                          Py_TYPE(items[i])->tp_name + ")");
      }
      dst[i] = checked<T>(v, begin + i);
    }
  }

 private:
  static bool int_buffer(const Py_buffer& view) {
    const char* f = view.format == nullptr ? "B" : view.format;
    if (*f == '@' || *f == '=' || *f == '<') ++f;   // native or little-endian (every host we build for)
    const bool signed_int = (*f == 'i' || *f == 'l' || *f == 'q') && f[1] == '\0';
    return signed_int && (view.itemsize == 4 || view.itemsize == 8);
  }

  // (Called from the constructor, whose throw runs no destructor: it releases what it holds first.)
  void check_length(int64_t got, int64_t expected) {
    if (got == expected) return;
    release();
    refuse(name_, "holds " + std::to_string(got) + " entries, not " + std::to_string(expected));
  }

  void release() {
    if (items_ != nullptr) Py_DECREF(items_);
    else PyBuffer_Release(&view_);   // a no-op on a view never taken or already released
    items_ = nullptr;
    view_.obj = nullptr;
  }

  template <typename T>
  T checked(long long v, int64_t index) const {
    if constexpr (sizeof(T) < sizeof(long long)) {
      if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max())
        refuse(name_, "entry " + std::to_string(index) + " = " + std::to_string(v) + " does not fit int32");
    }
    return static_cast<T>(v);
  }

  const char* name_;
  PyObject* items_ = nullptr;   // a list or tuple (a new reference), or null when view_ holds a buffer
  Py_buffer view_{};
  int itemsize_ = 0;
};

void check_layout(const DecodeStageLayout& lay, int64_t host_bytes, int64_t end) {
  const int64_t b = lay.batch;
  const bool ordered = b >= 1 && lay.context_at >= 32 * b && lay.work_at >= lay.context_at + 4 * b &&
                       lay.work_end >= lay.work_at && lay.tables_at >= lay.work_end && lay.context_at % 4 == 0 &&
                       lay.work_at % 16 == 0 && lay.work_end % 4 == 0 && lay.tables_at % 4 == 0;
  if (!ordered) refuse("layout", "offsets out of order or misaligned for a batch of " + std::to_string(b));
  if (end > host_bytes)
    refuse("host buffer", std::to_string(host_bytes) + " bytes, the step needs " + std::to_string(end));
}

}  // namespace

int64_t stage_decode_inputs(uint8_t* host, int64_t host_bytes, const DecodeStageLayout& lay,
                            const DecodeStagePlanner& planner, int64_t rows, PyObject* tokens, PyObject* positions,
                            PyObject* slots, PyObject* feedback_rows, PyObject* context_lens, PyObject* tables,
                            int64_t width, int64_t table_stride) {
  const int64_t b = lay.batch;
  if (rows < 1 || rows > b) refuse("rows", std::to_string(rows) + " is not in [1, " + std::to_string(b) + "]");
  if (width < 0 || table_stride < width)
    refuse("tables", "row stride " + std::to_string(table_stride) + " is below the width " + std::to_string(width));
  const int64_t end = lay.tables_at + 4 * rows * table_stride;
  check_layout(lay, host_bytes, std::max(end, lay.work_end));
  if (reinterpret_cast<uintptr_t>(host) % 8 != 0) refuse("host buffer", "not 8-byte aligned");

  int64_t* longs = reinterpret_cast<int64_t*>(host);
  IntSource(tokens, rows, "token_ids").copy(longs, 0, rows);
  IntSource(positions, rows, "positions").copy(longs + b, 0, rows);
  IntSource(slots, rows, "slot_mapping").copy(longs + 2 * b, 0, rows);
  if (feedback_rows == Py_None) std::fill(longs + 3 * b, longs + 3 * b + rows, int64_t{-1});
  else IntSource(feedback_rows, rows, "feedback_rows").copy(longs + 3 * b, 0, rows);
  for (int field = 0; field < 4; ++field)   // padding rows: token 0, position 0, no slot, not fed
    std::fill(longs + field * b + rows, longs + (field + 1) * b, field < 2 ? int64_t{0} : int64_t{-1});

  int32_t* context = reinterpret_cast<int32_t*>(host + lay.context_at);
  IntSource(context_lens, rows, "context_lens").copy(context, 0, rows);
  std::fill(context + rows, context + b, 0);

  if (planner.workers > 0) {
    int32_t* work = reinterpret_cast<int32_t*>(host + lay.work_at);
    const int64_t capacity = work_list_capacity((lay.work_end - lay.work_at) / 4, b);
    if (capacity < b) refuse("layout", "its work list holds too few ints for " + std::to_string(b) + " rows");
    const int n = plan_decode_work(context, static_cast<int>(b), planner.workers, planner.longest_item,
                                   static_cast<int>(capacity), planner.min_item, planner.item_cost, work);
    if (n < 0)
      refuse("context_lens", plan_decode_work_refusal(n, static_cast<int>(b), static_cast<int>(capacity),
                                                      planner.longest_item));
    work[2] = static_cast<int32_t>(table_stride);
  }

  IntSource table(tables, rows * width, "block_tables");
  int32_t* out = reinterpret_cast<int32_t*>(host + lay.tables_at);
  if (table_stride == width) {
    table.copy(out, 0, rows * width);
  } else {
    for (int64_t r = 0; r < rows; ++r) table.copy(out + r * table_stride, r * width, width);
  }
  return end;
}

}  // namespace kvpager
