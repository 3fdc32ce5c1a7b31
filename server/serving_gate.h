// Whether this coordinator may serve its shard now. Without an election (no
// gate) it always may. With one (--ha_etcd: a primary and standbys per
// shard, docs/design.md "Standby coordinators"), only as the elected
// primary, once its state is restored, and until its lease's fence runs out
// (ha/election.h): a standby, or a primary that could not renew its lease
// in time, refuses every call with UNAVAILABLE, and the member's client
// moves to the shard's next address.
#ifndef LOCALSGD_SERVER_SERVING_GATE_H_
#define LOCALSGD_SERVER_SERVING_GATE_H_

#include "absl/status/status.h"

namespace localsgd {

class ServingGate {
 public:
  virtual ~ServingGate() = default;
  // OK while this coordinator serves; else UNAVAILABLE with a message that
  // says what it is (a standby, a primary whose lease ran out) and which
  // primary it knows of, if any. Thread-safe; never blocks (every call
  // asks).
  virtual absl::Status Check() const = 0;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_SERVING_GATE_H_
