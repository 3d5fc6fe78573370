// Torch binding of decode_stage.h: a CUDA-graph decode step's host path in one call
// (worker/decode_graphs.py DecodeGraphs.run). It writes the step's inputs into the next of a few
// pinned buffers, sends them to the graphs' static input buffer in one copy, copies the fed ids
// beside them, and launches the step's graph. Registered by binding.cpp's module.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_stage.h"

namespace {

using torch::Tensor;

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument(what); }

// A pinned host buffer and the event of the last copy that read it.
struct PinnedSlot {
  uint8_t* data = nullptr;
  int64_t bytes = 0;
  cudaEvent_t copied = nullptr;   // recorded after each copy that reads the buffer
  bool pending = false;           // `copied` was recorded since the buffer was last filled
};

// One per DecodeGraphs: `layouts` are the batch buckets' byte offsets (batch, context_at,
// work_at, work_end, tables_at) in `inputs` (the graphs' uint8 device buffer) and in the pinned
// buffers; `previous` the int64 device ids a fed step's tokens are taken from; the work-list
// geometry the graphs were captured with (workers 0: none); `slots` pinned buffers, each as large
// as `inputs`, used in turn, each refilled only once the copy that last read it has run. One caller at a time (the worker
// runs steps under its lock): the ring's position is not guarded.
class DecodeStepStager {
 public:
  DecodeStepStager(Tensor inputs, Tensor previous, const std::vector<std::vector<int64_t>>& layouts, int64_t workers,
                   int64_t longest_item, int64_t min_item, int64_t item_cost, int64_t slots)
      : inputs_(std::move(inputs)), previous_(std::move(previous)),
        planner_{static_cast<int>(workers), static_cast<int>(longest_item), static_cast<int>(min_item),
                 static_cast<int>(item_cost)} {
    if (!inputs_.is_cuda() || inputs_.scalar_type() != torch::kUInt8 || !inputs_.is_contiguous())
      refuse("inputs must be a contiguous uint8 CUDA tensor");
    if (!previous_.is_cuda() || previous_.device() != inputs_.device() || previous_.scalar_type() != torch::kInt64 ||
        previous_.dim() != 1 || !previous_.is_contiguous())
      refuse("previous must be a contiguous 1-d int64 tensor on the inputs' device");
    if (workers < 0 || workers > 65535) refuse("workers must be in [0, 65535]");
    if (slots < 1 || slots > 64) refuse("slots must be in [1, 64]");
    for (const auto& l : layouts) {
      if (l.size() != 5) refuse("a layout is (batch, context_at, work_at, work_end, tables_at)");
      layouts_.push_back({l[0], l[1], l[2], l[3], l[4]});
    }
    // Every buffer at its full size now, never regrown: freeing pinned memory (cudaFreeHost)
    // synchronizes the device, which on the serving path drains the steps in flight.
    const c10::cuda::CUDAGuard guard(inputs_.device());
    slots_.resize(slots);
    for (auto& s : slots_) {
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
      void* data = nullptr;
      C10_CUDA_CHECK(cudaHostAlloc(&data, std::max<int64_t>(inputs_.numel(), 1), cudaHostAllocDefault));
      s.data = static_cast<uint8_t*>(data);
      s.bytes = inputs_.numel();
    }
  }

  ~DecodeStepStager() {   // (errors ignored: at exit the CUDA context may be gone already)
    for (auto& s : slots_) {
      if (s.copied != nullptr) cudaEventDestroy(s.copied);
      if (s.data != nullptr) cudaFreeHost(s.data);
    }
  }

  DecodeStepStager(const DecodeStepStager&) = delete;
  DecodeStepStager& operator=(const DecodeStepStager&) = delete;

  // Writes the step into the next pinned buffer (decode_stage.h says what goes where) for the
  // layout `bucket`, then enqueues on the device's current stream: its copy into `inputs`; for a
  // fed step, the copy of `previous_ids` ([n] int64 on the device, n <= previous) into
  // `previous`; and, when `graph_exec` is not 0, the launch of that cudaGraphExec_t (a graph
  // with no RNG consumers: torch's replay() would also advance the RNG's graph offsets).
  // Returns the bytes copied. Raises ValueError for bad input, with nothing enqueued.
  int64_t stage(int64_t bucket, int64_t graph_exec, py::handle tokens, py::handle positions, py::handle slots,
                py::handle feedback_rows, py::handle context_lens, py::handle tables, int64_t rows, int64_t width,
                int64_t table_stride, const std::optional<Tensor>& previous_ids) {
    if (bucket < 0 || bucket >= static_cast<int64_t>(layouts_.size()))
      refuse("bucket " + std::to_string(bucket) + " is not one of the " + std::to_string(layouts_.size()));
    const kvpager::DecodeStageLayout& lay = layouts_[bucket];
    if (previous_ids.has_value()) {
      const Tensor& ids = *previous_ids;
      if (ids.device() != previous_.device() || ids.scalar_type() != torch::kInt64 || ids.dim() != 1 ||
          !ids.is_contiguous() || ids.numel() > previous_.numel())
        refuse("previous_ids must be a contiguous 1-d int64 tensor on the graphs' device, at most " +
               std::to_string(previous_.numel()) + " long");
      if (feedback_rows.is_none()) refuse("previous_ids given for a step without feedback rows");
    }
    // (A step too large for the inputs buffer is refused by stage_decode_inputs: the pinned
    // buffers are that buffer's size.)
    const c10::cuda::CUDAGuard guard(inputs_.device());
    PinnedSlot& slot = next_slot();
    const int64_t end = kvpager::stage_decode_inputs(slot.data, slot.bytes, lay, planner_, rows, tokens.ptr(),
                                                     positions.ptr(), slots.ptr(), feedback_rows.ptr(),
                                                     context_lens.ptr(), tables.ptr(), width, table_stride);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    C10_CUDA_CHECK(cudaMemcpyAsync(inputs_.data_ptr(), slot.data, end, cudaMemcpyHostToDevice, stream));
    C10_CUDA_CHECK(cudaEventRecord(slot.copied, stream));
    slot.pending = true;
    if (previous_ids.has_value() && previous_ids->numel() > 0)
      C10_CUDA_CHECK(cudaMemcpyAsync(previous_.data_ptr(), previous_ids->data_ptr(), previous_ids->numel() * 8,
                                     cudaMemcpyDeviceToDevice, stream));
    if (graph_exec != 0) {
      const auto exec = reinterpret_cast<cudaGraphExec_t>(static_cast<intptr_t>(graph_exec));
      C10_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    }
    return end;
  }

 private:
  // The next buffer (as large as the inputs buffer), free to fill: the copy that last read it
  // has run (several steps ago, with a few buffers and two steps in flight). O(1).
  PinnedSlot& next_slot() {
    PinnedSlot& slot = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    if (slot.pending) {
      C10_CUDA_CHECK(cudaEventSynchronize(slot.copied));
      slot.pending = false;
    }
    return slot;
  }

  Tensor inputs_, previous_;
  std::vector<kvpager::DecodeStageLayout> layouts_;
  kvpager::DecodeStagePlanner planner_;
  std::vector<PinnedSlot> slots_;
  size_t next_ = 0;
};

}  // namespace

void bind_decode_stage(py::module_& m) {
  py::class_<DecodeStepStager>(m, "DecodeStepStager",
                               "a CUDA-graph decode step's host path: its inputs into pinned memory, onto the device, "
                               "and its graph's launch")
      .def(py::init<Tensor, Tensor, const std::vector<std::vector<int64_t>>&, int64_t, int64_t, int64_t, int64_t,
                    int64_t>(),
           py::arg("inputs"), py::arg("previous"), py::arg("layouts"), py::arg("workers"), py::arg("longest_item"),
           py::arg("min_item"), py::arg("item_cost"), py::arg("slots"))
      .def("stage", &DecodeStepStager::stage,
           "write a step's inputs, enqueue their copies and the graph's launch; the bytes copied", py::arg("bucket"),
           py::arg("graph_exec"), py::arg("tokens"), py::arg("positions"), py::arg("slots"),
           py::arg("feedback_rows"), py::arg("context_lens"), py::arg("tables"), py::arg("rows"), py::arg("width"),
           py::arg("table_stride"), py::arg("previous_ids"));
}
