#include "src/clock.h"

namespace localsgd {

Clock* Clock::Real() {
  class RealClock : public Clock {
   public:
    absl::Time Now() override { return absl::Now(); }
  };
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace localsgd
