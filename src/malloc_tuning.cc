#include "src/malloc_tuning.h"

#include <cstdlib>  // defines __GLIBC__ on glibc

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace localsgd {

bool KeepFreedMemoryForReuse() {
#if defined(__GLIBC__)
  // 32 MiB is the largest mmap threshold glibc takes on 64-bit systems
  // (HEAP_MAX_SIZE / 2); mallopt refuses more.
  const bool mmap_set = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool trim_set = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap_set && trim_set;
#else
  return false;
#endif
}

}  // namespace localsgd
