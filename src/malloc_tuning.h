// glibc malloc settings for a process that streams large messages.
//
// gRPC allocates a fresh buffer for each read from the socket and frees it
// once the message is consumed. With glibc's defaults, freed memory at the
// top of the heap goes back to the kernel (trim) and buffers past the
// adaptive mmap threshold are mapped per allocation, so a sync round pays a
// page fault and a page clear for every 4 KiB it moves (first touch runs at
// ~0.9 GB/s here against ~17 GB/s for a copy into warm memory). Keeping
// freed memory in the heap makes those buffers warm.
//
// The coordinator calls this at start (--keep_freed_memory, default on);
// workers may call it from main() (the example worker and bench/sync_bench
// do). It changes the process's allocator, so a library never calls it on
// its own. Peak memory does not grow; memory freed after a peak is kept for
// reuse instead of being returned to the kernel.
#ifndef LOCALSGD_SRC_MALLOC_TUNING_H_
#define LOCALSGD_SRC_MALLOC_TUNING_H_

namespace localsgd {

// Sets M_MMAP_THRESHOLD to 32 MiB (smaller blocks come from the heap; a
// whole-model buffer is still mapped on its own) and M_TRIM_THRESHOLD to
// 1 GiB. Returns false if glibc refused either (or this is not glibc).
bool KeepFreedMemoryForReuse();

}  // namespace localsgd

#endif  // LOCALSGD_SRC_MALLOC_TUNING_H_
