// Programmatic dependent launch (Hopper): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream still runs, once every block of that one has called allow_dependent_launch (or exited);
// it must call wait_for_prerequisite_grids before it reads anything that kernel writes (or writes
// anything that kernel reads): the wait returns once that grid has completed and its writes are
// visible. Both are no-ops before sm_90 and with KVPAGER_DECODE_PDL=0 (the launchers then launch
// plainly). Used twice (launch.cu):
// - the merge as a dependent of the decode kernel: its launch and its blocks' start overlap the
//   decode's last wave (the decode blocks allow it from their start);
// - the decode kernel as a dependent of write_kv (KVPAGER_DECODE_PDL_AFTER_WRITE, default 1): a
//   model layer writes the step's new K/V, then attends; the decode blocks read their work list,
//   block tables and query (none written by write_kv) before the wait, and the K/V after it.
#pragma once

#ifndef KVPAGER_DECODE_PDL
#define KVPAGER_DECODE_PDL 1
#endif
#ifndef KVPAGER_DECODE_PDL_AFTER_WRITE
#define KVPAGER_DECODE_PDL_AFTER_WRITE 1
#endif

namespace kvpager {

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && KVPAGER_DECODE_PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && KVPAGER_DECODE_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace kvpager
