// A regional coordinator's link to its upstream coordinator (src/upstream.h,
// docs/design.md "Regional coordinators"): one per job, a member of the
// upstream job of the same name through the client library (client/client.h:
// its retries, re-joins, sharded and standby upstreams, TLS and token), on a
// thread of its own so that the job's lock is never held across the wide
// area.
//
// A seed: Client::Initialize with the seed's values (the upstream job takes
// them if it has no state, else its state comes back); the answer is the
// state. A round: if the round's base is the upstream state the link holds
// (bit for bit), it contributes base + mean (the client sends that minus
// its anchor, the base: the mean within float32 rounding) with the round's
// weight, and answers the upstream round's step as the client's new state
// minus the base, when adding that back to the base gives the new state bit
// for bit in every element (otherwise the new state whole; a contribution
// that did not count upstream gets the step marked so). A base that is not
// the upstream state (a
// regional coordinator restarted while the upstream job went on) is answered
// with the upstream state whole, contributing nothing.
//
// Pipelined down: while a round's Sync runs, each result chunk the upstream
// sends before its round's result (full duplex: the chunks final there)
// goes to the job at once as that chunk's step (Job::UpstreamChunk), when
// it passes the same bit-for-bit test, so that the region's members get it
// while the rest still crosses the wide area. The whole answer follows as
// before; the job checks that it holds the same steps.
//
// A request that fails (the client's retries spent, a refusal) drops the
// client: the next one joins again as a new incarnation of the same member
// name (taking the old one's place upstream) and fetches the upstream
// state, whatever went wrong (an upstream restarted without its members,
// a sharded upstream whose shards went different ways).
//
// Memory: the upstream state (one float per element) besides the client's
// anchor and result buffers (two).
#ifndef LOCALSGD_SERVER_UPSTREAM_LINK_H_
#define LOCALSGD_SERVER_UPSTREAM_LINK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "client/client.h"
#include "src/layout.h"
#include "src/upstream.h"

namespace localsgd {

class UpstreamLink final : public Upstream {
 public:
  // `options`: the client's, with the upstream's address and credentials;
  // job_id and the contribution are set here.
  UpstreamLink(std::string job_id, Layout layout, uint64_t num_elements,
               ClientOptions options);
  // Stop.
  ~UpstreamLink() override;

  void Submit(std::weak_ptr<Job> job, UpstreamRequest request) override;
  // Asks the thread to leave the upstream job and end, and waits for it a
  // few seconds: a thread still in a call to the upstream (bounded by the
  // client's timeouts) ends on its own, holding what it uses.
  void Stop() override;
  UpstreamStatus Status() const override;

  // The link's state, shared with its thread (server/upstream_link.cc).
  struct Core;

 private:
  std::shared_ptr<Core> core_;
  std::thread thread_;
};

// Makes an UpstreamLink per job, all to one upstream (CoordinatorOptions::
// upstream).
class UpstreamLinkFactory final : public UpstreamFactory {
 public:
  explicit UpstreamLinkFactory(ClientOptions options)
      : options_(std::move(options)) {}
  std::unique_ptr<Upstream> ForJob(const std::string& job_id,
                                   const Layout& layout,
                                   uint64_t num_elements) override;
  std::string target() const override;

 private:
  const ClientOptions options_;
};

}  // namespace localsgd

#endif  // LOCALSGD_SERVER_UPSTREAM_LINK_H_
