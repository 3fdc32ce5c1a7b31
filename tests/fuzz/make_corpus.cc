// Writes the seed corpus of the fuzzers: tests/fuzz/corpus/<target>/<name>,
// each a binary script message (tests/fuzz/fuzz_input.proto). The seeds are
// well-formed sessions and the classic hostile inputs, so that the fuzzer
// starts deep in the protocol. Regenerate after changing this file:
//
//   ninja -C build-fuzz fuzz_make_corpus
//   build-fuzz/tests/fuzz/fuzz_make_corpus tests/fuzz/corpus
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "fuzz_input.pb.h"
#include "proto/convert.h"
#include "src/layout.h"
#include "src/sparse_codec.h"

namespace localsgd {
namespace fuzz {
namespace {

std::string g_dir;

void Write(const std::string& target, const std::string& name,
           const google::protobuf::Message& message) {
  const std::filesystem::path dir = std::filesystem::path(g_dir) / target;
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out << message.SerializeAsString();
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

void FillLayout(const std::vector<int64_t>& sizes, v1::Layout* proto,
                DType dtype = DType::kFloat32) {
  std::vector<TensorSpec> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back({"t" + std::to_string(i), {sizes[i]}, dtype});
  }
  LayoutToProto(MakeLayout(tensors), proto);
}

std::string Floats(std::vector<float> values) {
  std::string out(values.size() * 4, '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

Prologue MakePrologue(int members, bool seed, bool bf16 = false,
                      std::vector<uint32_t> sizes = {5, 3},
                      uint32_t chunk = 4) {
  Prologue p;
  for (uint32_t s : sizes) p.add_tensor_sizes(s);
  p.set_chunk_elements(chunk);
  p.set_bfloat16(bf16);
  p.set_members(members);
  p.set_seed(seed);
  for (int i = 0; i < members; ++i) p.add_weights(1 + i % 3);
  return p;
}

// Step builders.
Step Header(uint32_t stream, uint32_t member_ref, int delta = 1,
            bool fingerprint = true) {
  Step s;
  SyncMessage* m = s.mutable_sync();
  m->set_stream(stream);
  m->mutable_request()->mutable_header();
  m->set_member_ref(member_ref);
  m->set_relative_round(true);
  m->set_round_delta(delta);
  m->set_fix_fingerprint(fingerprint);
  return s;
}
Step ChunkStep(uint32_t stream, uint32_t index, std::string data,
               bool fix_size = true, bool fix_crc = true) {
  Step s;
  SyncMessage* m = s.mutable_sync();
  m->set_stream(stream);
  m->mutable_request()->mutable_chunk()->set_index(index);
  m->mutable_request()->mutable_chunk()->set_data(std::move(data));
  m->set_fix_size(fix_size);
  m->set_fix_crc(fix_crc);
  return s;
}
Step Round(uint32_t mask, uint32_t seed) {
  Step s;
  s.mutable_round()->set_members_mask(mask);
  s.mutable_round()->set_value_seed(seed);
  return s;
}
Step Advance(uint32_t ms) {
  Step s;
  s.set_advance_ms(ms);
  return s;
}
Step End(uint32_t stream) {
  Step s;
  s.set_end_stream(stream);
  return s;
}
Step Cancel(uint32_t stream) {
  Step s;
  s.set_cancel_stream(stream);
  return s;
}
Step LeaveStep(uint32_t ref) {
  Step s;
  s.mutable_leave()->set_member_ref(ref);
  return s;
}
Step HeartbeatStep(uint32_t ref) {
  Step s;
  s.mutable_heartbeat()->set_member_ref(ref);
  return s;
}
Step Fetch(uint32_t ref, bool fingerprint = true) {
  Step s;
  s.mutable_fetch()->set_member_ref(ref);
  s.mutable_fetch()->set_fix_fingerprint(fingerprint);
  return s;
}
Step Status(const std::string& job = "") {
  Step s;
  s.mutable_status()->set_job_id(job);
  return s;
}
Step JoinHostile(const std::string& name, uint64_t incarnation = 7) {
  Step s;
  JoinStep* j = s.mutable_join();
  j->set_complete(true);
  j->mutable_request()->set_member_name(name);
  j->mutable_request()->set_incarnation(incarnation);
  return s;
}

// All chunks of an 8-element layout in chunks of 4, values `v`, on `stream`.
void SendAll(SyncScript& script, uint32_t stream, float v) {
  *script.add_steps() = ChunkStep(stream, 0, Floats({v, v, v, v}));
  *script.add_steps() = ChunkStep(stream, 1, Floats({v, -v, v, -v}));
}

// Two members "a" and "b" join `job` (70 elements in chunks of 40 and 30,
// OUTER_NESTEROV over `wire`, sparse_keep `keep` if not 0) by Join steps,
// and "a" seeds it in float32.
void JoinAndSeedPseudoGradientJob(SyncScript& s, const std::string& job,
                                  v1::DType wire, uint32_t keep) {
  for (int k = 0; k < 2; ++k) {
    Step join;
    JoinStep* j = join.mutable_join();
    j->mutable_request()->set_job_id(job);
    j->mutable_request()->set_member_name(k == 0 ? "a" : "b");
    j->mutable_request()->set_incarnation(5 + k);
    FillLayout({70}, j->mutable_request()->mutable_layout());
    v1::JobSettings* settings = j->mutable_request()->mutable_settings();
    settings->set_chunk_elements(40);
    settings->set_contribution(v1::CONTRIBUTION_PSEUDO_GRADIENTS);
    settings->set_mode(v1::AVERAGING_MODE_OUTER_NESTEROV);
    settings->set_wire_dtype(wire);
    if (keep != 0) settings->set_sparse_keep(keep);
    *s.add_steps() = join;
  }
  *s.add_steps() = Header(0, 1, 0);
  *s.add_steps() = ChunkStep(0, 0, Floats(std::vector<float>(40, 0.5f)));
  *s.add_steps() = ChunkStep(0, 1, Floats(std::vector<float>(30, -0.5f)));
}

void SyncCorpus() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  {
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Round(7, 1);
    *s.add_steps() = Round(7, 2);
    Write("sync", "rounds_complete", s);
  }
  {
    // A raw member among honest ones, with distinct values and weights.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Header(0, 3);
    SendAll(s, 0, 1.5f);
    *s.add_steps() = Round(3, 9);
    Write("sync", "raw_member_round", s);
  }
  {
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, true, /*bf16=*/true);
    *s.add_steps() = Header(0, 2);
    SendAll(s, 0, 0.25f);
    *s.add_steps() = Round(1, 4);
    Write("sync", "bf16_round", s);
  }
  {
    // The seed sent through the fuzzed stream, chunks out of order and one
    // repeated with other data (counts once).
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, false);
    *s.add_steps() = Header(0, 1, 0);
    *s.add_steps() = ChunkStep(0, 1, Floats({1, 2, 3, 4}));
    *s.add_steps() = ChunkStep(0, 1, Floats({5, 6, 7, 8}));
    *s.add_steps() = ChunkStep(0, 0, Floats({9, 9, 9, 9}));
    *s.add_steps() = Round(3, 5);
    Write("sync", "seed_raw_duplicate_chunk", s);
  }
  {
    // Non-finite values after a good chunk: the good one stays counted.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Header(0, 3);
    *s.add_steps() = ChunkStep(0, 0, Floats({2, 2, 2, 2}));
    *s.add_steps() = ChunkStep(0, 1, Floats({1, nan, 1, 1}));
    *s.add_steps() = Round(3, 6);
    *s.add_steps() = LeaveStep(3);
    Write("sync", "nan_after_good_chunk", s);
  }
  {
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, true, /*bf16=*/true);
    *s.add_steps() = Header(0, 2);
    std::string bf(8, '\0');
    bf[6] = '\x80';
    bf[7] = '\x7f';  // +inf in bfloat16
    *s.add_steps() = ChunkStep(0, 0, bf, false, true);
    *s.add_steps() = Round(1, 3);
    *s.add_steps() = Advance(20000);
    Write("sync", "bf16_inf_lease", s);
  }
  {
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, true);
    *s.add_steps() = Header(1, 2);
    *s.add_steps() = ChunkStep(1, 0, Floats({-inf, 1, 1, 1}));
    Write("sync", "fp32_minus_inf", s);
  }
  {
    // Protocol errors: chunk before header, second header, no crc, bad crc,
    // out-of-range index, wrong size, empty message.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, true);
    *s.add_steps() = ChunkStep(0, 0, Floats({1, 1, 1, 1}));
    *s.add_steps() = Header(1, 1);
    *s.add_steps() = Header(1, 1);
    *s.add_steps() = Header(2, 1);
    *s.add_steps() = ChunkStep(2, 0, Floats({1, 1, 1, 1}), true, false);
    *s.add_steps() = Header(3, 1);
    Step bad_crc = ChunkStep(3, 0, Floats({1, 1, 1, 1}), true, false);
    bad_crc.mutable_sync()->mutable_request()->mutable_chunk()->set_crc32c(1);
    *s.add_steps() = bad_crc;
    *s.add_steps() = Header(4, 1);
    *s.add_steps() = ChunkStep(4, 99, Floats({1, 1, 1, 1}), false, true);
    *s.add_steps() = Header(5, 1);
    *s.add_steps() = ChunkStep(5, 0, Floats({1, 1, 1}), false, true);
    Step empty;
    empty.mutable_sync()->set_stream(6);
    *s.add_steps() = empty;
    *s.add_steps() = Round(3, 2);
    Write("sync", "protocol_errors", s);
  }
  {
    // Header errors: no fingerprint, wrong fingerprint, future round, past
    // round, malformed and unknown member, unknown job.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, true);
    *s.add_steps() = Header(0, 1, 1, false);
    Step wrong = Header(1, 1, 1, false);
    wrong.mutable_sync()
        ->mutable_request()
        ->mutable_header()
        ->set_layout_fingerprint(12345);
    *s.add_steps() = wrong;
    *s.add_steps() = Header(2, 1, 50);
    *s.add_steps() = Header(3, 1, -1);
    Step malformed = Header(4, 0);
    malformed.mutable_sync()->mutable_request()->mutable_header()->set_job_id(
        "job");
    malformed.mutable_sync()
        ->mutable_request()
        ->mutable_header()
        ->set_member_id("not-a-member");
    *s.add_steps() = malformed;
    Step unknown = malformed;
    unknown.mutable_sync()->set_stream(5);
    unknown.mutable_sync()->mutable_request()->mutable_header()->set_member_id(
        std::string(32, 'a'));
    *s.add_steps() = unknown;
    Step nojob = unknown;
    nojob.mutable_sync()->set_stream(6);
    nojob.mutable_sync()->mutable_request()->mutable_header()->set_job_id(
        "nojob");
    *s.add_steps() = nojob;
    *s.add_steps() = Round(3, 1);
    Write("sync", "header_errors", s);
  }
  {
    // Truncated streams: ends after one chunk, cancelled, never ends (the
    // lease closes the round).
    SyncScript s;
    s.mutable_config()->set_lease_ttl_ms(500);
    *s.mutable_prologue() = MakePrologue(4, true);
    *s.add_steps() = Header(0, 2);
    *s.add_steps() = ChunkStep(0, 0, Floats({3, 3, 3, 3}));
    *s.add_steps() = End(0);
    *s.add_steps() = Header(1, 3);
    *s.add_steps() = Cancel(1);
    *s.add_steps() = Header(2, 4);
    *s.add_steps() = ChunkStep(2, 1, Floats({4, 4, 4, 4}));
    *s.add_steps() = Round(1, 8);
    *s.add_steps() = Advance(400);
    *s.add_steps() = HeartbeatStep(1);
    *s.add_steps() = Advance(400);
    *s.add_steps() = Status("job");
    Write("sync", "truncated_streams_lease", s);
  }
  {
    // Deadline with quorum: one member never sends.
    SyncScript s;
    s.mutable_config()->set_round_deadline_ms(1000);
    s.mutable_config()->set_min_quorum(2);
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Round(3, 4);
    *s.add_steps() = Advance(1500);
    *s.add_steps() = Round(7, 5);
    Write("sync", "deadline_quorum", s);
  }
  {
    // Rendezvous: rounds wait for the members to gather.
    SyncScript s;
    Prologue p = MakePrologue(2, true);
    p.set_rendezvous_members(3);
    *s.mutable_prologue() = p;
    *s.add_steps() = Round(3, 1);
    *s.add_steps() = JoinHostile("late", 3);
    *s.add_steps() = Header(0, 3);
    SendAll(s, 0, 2.0f);
    *s.add_steps() = Advance(30000);
    Write("sync", "rendezvous", s);
  }
  {
    // A member replaced by a new incarnation mid-round, and a leave.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Round(1, 2);
    Step replace = JoinHostile("p1", 99);
    *s.add_steps() = replace;
    *s.add_steps() = LeaveStep(3);
    *s.add_steps() = Status();
    *s.add_steps() = Round(7, 3);
    Write("sync", "replace_and_leave", s);
  }
  {
    // Larger model, several chunks, bf16.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(4, true, true, {64, 64, 7}, 16);
    *s.add_steps() = Round(15, 11);
    *s.add_steps() = Fetch(2);
    *s.add_steps() = Round(15, 12);
    Write("sync", "bf16_many_chunks", s);
  }
  {
    // No prologue: a job made of Join steps.
    SyncScript s;
    Step join;
    JoinStep* j = join.mutable_join();
    j->mutable_request()->set_job_id("j2");
    j->mutable_request()->set_member_name("a");
    j->mutable_request()->set_incarnation(5);
    FillLayout({3}, j->mutable_request()->mutable_layout());
    j->mutable_request()->mutable_settings()->set_chunk_elements(2);
    *s.add_steps() = join;
    *s.add_steps() = Header(0, 1, 0);
    *s.add_steps() = ChunkStep(0, 0, Floats({1, 2}));
    *s.add_steps() = ChunkStep(0, 1, Floats({3}));
    *s.add_steps() = Header(1, 1, 1);
    *s.add_steps() = ChunkStep(1, 0, Floats({5, 6}));
    *s.add_steps() = ChunkStep(1, 1, Floats({7}));
    *s.add_steps() = Fetch(1);
    Write("sync", "join_steps_only", s);
  }
  {
    // A job of pseudo-gradients made of Join steps: OUTER_NESTEROV over
    // int4, a float32 seed, then rounds of deltas against the current state
    // (fix_anchor) and one against no state at all.
    SyncScript s;
    JoinAndSeedPseudoGradientJob(s, "pg", v1::DTYPE_INT4_BLOCK, 0);
    for (uint32_t m = 1; m <= 2; ++m) {
      Step h = Header(m, m, 1);
      h.mutable_sync()->set_fix_anchor(true);
      *s.add_steps() = h;
      std::string block(4 + 20, '\x11');
      const float scale = 0.01f * m;
      std::memcpy(block.data(), &scale, 4);
      *s.add_steps() = ChunkStep(m, 0, block);
      *s.add_steps() = ChunkStep(m, 1, block);
    }
    *s.add_steps() = Header(3, 1, 1);  // no anchor: INVALID_ARGUMENT
    *s.add_steps() = Fetch(2);
    Write("sync", "pseudo_gradient_int4_nesterov", s);
  }
  {
    // The same over sparse2, 2048 of 4096 kept (20 of a chunk of 40, 15 of
    // the last one of 30): valid deltas, then one whose positions descend
    // and one with lo > hi (INVALID_ARGUMENT).
    const SparseCode code{2048, 2};
    auto sparse = [&](size_t n, float base) {
      std::vector<float> values(n);
      for (size_t i = 0; i < n; ++i) values[i] = base * (1.0f + 0.1f * i);
      std::string data(SparseWireBytes(n, code), '\0');
      EncodeSparseWithFeedback(values, {}, code, data.data());
      return data;
    };
    SyncScript s;
    JoinAndSeedPseudoGradientJob(s, "sp", v1::DTYPE_SPARSE2, code.keep);
    for (uint32_t m = 1; m <= 2; ++m) {
      Step h = Header(m, m, 1);
      h.mutable_sync()->set_fix_anchor(true);
      *s.add_steps() = h;
      *s.add_steps() = ChunkStep(m, 0, sparse(40, 0.01f * m));
      *s.add_steps() = ChunkStep(m, 1, sparse(30, -0.01f * m));
    }
    std::string descending = sparse(40, 0.02f);
    std::swap(descending[8], descending[10]);
    std::string inverted = sparse(40, 0.02f);
    std::swap_ranges(inverted.begin(), inverted.begin() + 4,
                     inverted.begin() + 4);
    for (uint32_t m = 3; m <= 4; ++m) {
      Step h = Header(m, 1, 1);
      h.mutable_sync()->set_fix_anchor(true);
      *s.add_steps() = h;
      *s.add_steps() = ChunkStep(m, 0, m == 3 ? descending : inverted);
    }
    *s.add_steps() = Fetch(2);
    Write("sync", "pseudo_gradient_sparse2_nesterov", s);
  }
  {
    // A member whose weight is subnormal in fp32, among normal ones.
    SyncScript s;
    *s.mutable_prologue() = MakePrologue(2, true);
    Step join = JoinHostile("tiny", 5);
    join.mutable_join()->mutable_request()->set_weight(1e-40);
    *s.add_steps() = join;
    *s.add_steps() = Header(0, 3);
    SendAll(s, 0, 0.3f);
    *s.add_steps() = Round(3, 2);
    Write("sync", "tiny_weight", s);
  }
}

void FetchCorpus() {
  {
    FetchStateScript s;
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Round(7, 1);
    *s.add_steps() = Round(7, 2);
    Write("fetch_state", "rounds", s);
  }
  {
    FetchStateScript s;
    *s.mutable_prologue() = MakePrologue(2, false);
    *s.add_steps() = Fetch(1);     // no state yet
    *s.add_steps() = Round(1, 1);  // the seed
    *s.add_steps() = Round(3, 2);
    Write("fetch_state", "before_and_after_seed", s);
  }
  {
    FetchStateScript s;
    *s.mutable_prologue() = MakePrologue(2, true, true);
    Step f = Fetch(0, false);
    f.mutable_fetch()->mutable_request()->set_job_id("job");
    f.mutable_fetch()->mutable_request()->set_member_id("zz");
    *s.add_steps() = f;
    f.mutable_fetch()->mutable_request()->set_member_id(std::string(32, 'f'));
    *s.add_steps() = f;
    f.mutable_fetch()->mutable_request()->set_job_id("no/such job");
    *s.add_steps() = f;
    Step wrong = Fetch(1, false);
    wrong.mutable_fetch()->mutable_request()->set_layout_fingerprint(42);
    *s.add_steps() = wrong;
    *s.add_steps() = Fetch(2, false);  // no fingerprint
    *s.add_steps() = Round(3, 7);
    Write("fetch_state", "bad_requests_bf16", s);
  }
  {
    // An open round does not change the state others fetch.
    FetchStateScript s;
    *s.mutable_prologue() = MakePrologue(3, true);
    *s.add_steps() = Round(1, 4);
    *s.add_steps() = Round(2, 4);
    *s.add_steps() = LeaveStep(3);
    *s.add_steps() = Round(3, 5);
    Write("fetch_state", "open_round_then_leave", s);
  }
  {
    // Leases run out: fetch is NOT_FOUND for the expired.
    FetchStateScript s;
    s.mutable_config()->set_lease_ttl_ms(1000);
    *s.mutable_prologue() = MakePrologue(2, true);
    *s.add_steps() = Advance(600);
    *s.add_steps() = HeartbeatStep(1);
    *s.add_steps() = Advance(600);
    *s.add_steps() = Round(3, 1);
    Write("fetch_state", "lease_expiry", s);
  }
  {
    FetchStateScript s;
    *s.mutable_prologue() = MakePrologue(4, true, false, {64, 64, 64, 9}, 64);
    *s.add_steps() = Round(15, 3);
    *s.add_steps() = JoinHostile("late");
    *s.add_steps() = Round(15, 4);
    Write("fetch_state", "late_joiner", s);
  }
}

void JoinCorpus() {
  auto join = [](const std::string& job, const std::string& name,
                 uint64_t incarnation, std::vector<int64_t> sizes) {
    JoinStep j;
    j.mutable_request()->set_job_id(job);
    j.mutable_request()->set_member_name(name);
    j.mutable_request()->set_incarnation(incarnation);
    FillLayout(sizes, j.mutable_request()->mutable_layout());
    return j;
  };
  {
    JoinScript s;
    *s.add_joins() = join("job", "a", 1, {10, 5});
    *s.add_joins() = join("job", "b", 2, {10, 5});
    *s.add_joins() = join("job", "a", 1, {10, 5});  // retried
    *s.add_joins() = join("job", "a", 3, {10, 5});  // restarted
    *s.add_joins() = join("job", "", 4, {10, 5});   // unnamed
    *s.add_after() = HeartbeatStep(1);
    *s.add_after() = Status("job");
    Write("join", "members", s);
  }
  {
    JoinScript s;
    JoinStep j = join("job", "a", 1, {10, 5});
    v1::JobSettings* st = j.mutable_request()->mutable_settings();
    st->set_chunk_elements(4);
    st->set_wire_dtype(v1::DTYPE_BFLOAT16);
    st->set_local_sgd_steps(8);
    st->set_rendezvous_members(2);
    st->set_mode(v1::AVERAGING_MODE_MEAN);
    *s.add_joins() = j;
    // Mismatched settings, one field each.
    JoinStep k = j;
    k.mutable_request()->set_member_name("b");
    k.mutable_request()->mutable_settings()->set_chunk_elements(5);
    *s.add_joins() = k;
    k = j;
    k.mutable_request()->set_member_name("c");
    k.mutable_request()->mutable_settings()->set_wire_dtype(v1::DTYPE_FLOAT32);
    *s.add_joins() = k;
    k = j;
    k.mutable_request()->set_member_name("d");
    k.mutable_request()->mutable_settings()->set_local_sgd_steps(9);
    *s.add_joins() = k;
    k = j;
    k.mutable_request()->set_member_name("e");
    k.mutable_request()->mutable_settings()->set_rendezvous_members(3);
    *s.add_joins() = k;
    Write("join", "settings_mismatch", s);
  }
  {
    // Bad settings on a new job.
    JoinScript s;
    JoinStep j = join("s1", "a", 1, {10});
    j.mutable_request()->mutable_settings()->set_chunk_elements(0xffffffffu);
    *s.add_joins() = j;
    j.mutable_request()->set_job_id("s2");
    j.mutable_request()->mutable_settings()->set_chunk_elements(0);
    j.mutable_request()->mutable_settings()->set_wire_dtype(v1::DTYPE_FLOAT16);
    *s.add_joins() = j;
    j.mutable_request()->set_job_id("s3");
    j.mutable_request()->mutable_settings()->set_wire_dtype(
        static_cast<v1::DType>(77));
    *s.add_joins() = j;
    j.mutable_request()->set_job_id("s4");
    j.mutable_request()->mutable_settings()->set_wire_dtype(
        v1::DTYPE_UNSPECIFIED);
    j.mutable_request()->mutable_settings()->set_mode(
        static_cast<v1::AveragingMode>(9));
    *s.add_joins() = j;
    j.mutable_request()->set_job_id("s5");
    j.mutable_request()->mutable_settings()->set_mode(
        v1::AVERAGING_MODE_UNSPECIFIED);
    j.mutable_request()->mutable_settings()->set_rendezvous_members(100000);
    *s.add_joins() = j;
    Write("join", "bad_settings", s);
  }
  {
    // Bad layouts: duplicate names, negative and overflowing dims, unknown
    // dtype, no tensors, empty name, wrong fingerprint, rank 17, zero size.
    JoinScript s;
    JoinStep j = join("l1", "a", 1, {4, 4});
    j.mutable_request()->mutable_layout()->mutable_tensors(1)->set_name("t0");
    *s.add_joins() = j;
    j = join("l2", "a", 1, {-4});
    *s.add_joins() = j;
    j = join("l3", "a", 1, {int64_t{1} << 40, int64_t{1} << 40});
    *s.add_joins() = j;
    j = join("l4", "a", 1, {4});
    j.mutable_request()->mutable_layout()->mutable_tensors(0)->set_dtype(
        static_cast<v1::DType>(12));
    *s.add_joins() = j;
    j = join("l5", "a", 1, {});
    *s.add_joins() = j;
    j = join("l6", "a", 1, {4});
    j.mutable_request()->mutable_layout()->mutable_tensors(0)->set_name("");
    *s.add_joins() = j;
    j = join("l7", "a", 1, {4});
    j.mutable_request()->mutable_layout()->set_fingerprint(1);
    *s.add_joins() = j;
    j = join("l8", "a", 1, {0});
    *s.add_joins() = j;
    j = join("l9", "a", 1, {4});
    for (int i = 0; i < 16; ++i) {
      j.mutable_request()->mutable_layout()->mutable_tensors(0)->add_shape(1);
    }
    *s.add_joins() = j;
    Write("join", "bad_layouts", s);
  }
  {
    // Bad identities: job ids, names, weights, incarnation.
    JoinScript s;
    *s.add_joins() = join("", "a", 1, {4});
    *s.add_joins() = join(std::string(129, 'j'), "a", 1, {4});
    // (Not UTF-8 would not parse, here as on the server: no such seed.)
    *s.add_joins() = join("bad id/\xc3\xa9", "a", 1, {4});
    *s.add_joins() = join("job", std::string(300, 'n'), 1, {4});
    *s.add_joins() = join("job", "\xf0\x9f\x98\x80 \t\n", 1, {4});
    *s.add_joins() = join("job", "zero", 0, {4});
    JoinStep w = join("job", "w", 1, {4});
    for (double weight : {-1.0, std::nan(""), HUGE_VAL, 1e300, 1e-300}) {
      w.mutable_request()->set_weight(weight);
      *s.add_joins() = w;
    }
    Write("join", "bad_identities", s);
  }
  {
    // Layout mismatch with an existing job, other job, limits.
    JoinScript s;
    s.mutable_config()->set_max_members(2);
    s.mutable_config()->set_max_jobs(2);
    *s.add_joins() = join("a", "m1", 1, {8, 8});
    *s.add_joins() = join("a", "m2", 1, {8, 9});
    *s.add_joins() = join("a", "m3", 1, {8});
    *s.add_joins() = join("a", "m4", 1, {8, 8});
    *s.add_joins() = join("a", "m5", 1, {8, 8});  // max members
    *s.add_joins() = join("b", "m1", 1, {3});
    *s.add_joins() = join("c", "m1", 1, {3});  // max jobs
    *s.add_after() = LeaveStep(1);
    *s.add_after() = Advance(100);
    Write("join", "mismatch_and_limits", s);
  }
  {
    // Join rate: the same name again and again.
    JoinScript s;
    for (int i = 0; i < 30; ++i) *s.add_joins() = join("r", "x", 1 + i, {2});
    *s.add_after() = Advance(10);
    Write("join", "rate", s);
  }
}

// The replica fuzzer: a standby's stream, well-formed and not.
void ReplicaSettings(v1::JobSettings* s, v1::AveragingMode mode,
                     bool wire_mean = false) {
  s->set_local_sgd_steps(1);
  s->set_chunk_elements(4);
  s->set_wire_dtype(wire_mean ? v1::DTYPE_BFLOAT16 : v1::DTYPE_FLOAT32);
  s->set_mean_encoding(wire_mean ? v1::MEAN_ENCODING_WIRE
                                 : v1::MEAN_ENCODING_FLOAT32);
  s->set_mode(mode);
  s->set_nonfinite_policy(v1::NON_FINITE_POLICY_REJECT);
  s->set_contribution(v1::CONTRIBUTION_PSEUDO_GRADIENTS);
  s->set_outer_lr(0.7f);
  s->set_outer_momentum(0.9f);
  s->set_deadline_mode(v1::DEADLINE_MODE_FIXED);
  s->set_outlier_ratio(10);
}

// Members m0 and m1 of job "j", as a primary replicates them.
template <typename Field>
void AddMembers(Field* members) {
  for (int i = 0; i < 2; ++i) {
    v1::ReplicaMember* m = members->Add();
    m->set_id(std::string(31, 'a') + static_cast<char>('0' + i));
    m->set_name("m" + std::to_string(i));
    m->set_weight(1 + i);
    m->set_incarnation(7);
    m->set_first_round(1);
  }
}

// The catch-up of job "j" (10 elements, chunks of 4) at round `round`.
void AddCatchUp(ReplicaScript& s, uint64_t round, uint64_t state_id,
                v1::AveragingMode mode, uint32_t finals = 0,
                bool wire_mean = false) {
  v1::JobReplica* job = s.add_updates()->mutable_job();
  job->set_job_id("j");
  FillLayout({6, 4}, job->mutable_layout());
  ReplicaSettings(job->mutable_settings(), mode, wire_mean);
  job->set_has_state(true);
  job->set_round(round);
  job->set_state_id(state_id);
  job->set_final_chunks(finals);
  AddMembers(job->mutable_members());
  for (uint32_t c = 0; c < 3; ++c) {
    v1::ReplicaStateChunk* chunk = s.add_updates()->mutable_state_chunk();
    chunk->set_job_id("j");
    chunk->set_index(c);
    const size_t n = c < 2 ? 4 : 2;
    chunk->set_values(Floats(std::vector<float>(n, 1.0f + c)));
    if (mode == v1::AVERAGING_MODE_OUTER_NESTEROV) {
      chunk->set_momentum(Floats(std::vector<float>(n, 0.5f)));
    }
  }
}

// `values` in bfloat16 (each exact in it), little-endian.
std::string Bf16s(std::vector<float> values) {
  std::string out;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    out.push_back(static_cast<char>((bits >> 16) & 0xff));
    out.push_back(static_cast<char>(bits >> 24));
  }
  return out;
}

// Round `round`'s chunks (but `final_already`, final in the catch-up) and
// its commit; with `wire_mean`, each chunk's mean encoded in bfloat16 (a
// job of mean encoding wire).
void AddRound(ReplicaScript& s, uint64_t round, uint64_t previous, uint64_t id,
              int final_already = -1, bool wire_mean = false) {
  for (uint32_t c = 0; c < 3; ++c) {
    if (static_cast<int>(c) == final_already) continue;
    v1::ChunkFinal* chunk = s.add_updates()->mutable_chunk();
    chunk->set_job_id("j");
    chunk->set_round(round);
    chunk->set_index(c);
    chunk->set_contributed(true);
    const std::vector<float> mean(c < 2 ? 4 : 2, 0.25f * (c + 1));
    if (wire_mean) {
      chunk->set_encoded_mean(Bf16s(mean));
    } else {
      chunk->set_mean(Floats(mean));
    }
  }
  v1::StateCommit* commit = s.add_updates()->mutable_commit();
  commit->set_job_id("j");
  commit->set_round(round);
  commit->set_state_id(id);
  commit->set_previous_id(previous);
  commit->mutable_record()->set_round(round);
  commit->mutable_record()->add_contributors("m0");
  commit->set_contributor_weight(1);
  AddMembers(commit->mutable_members());
}

void ReplicaCorpus() {
  {
    // A catch-up, then two rounds; promoted.
    ReplicaScript s;
    s.set_epoch(5);
    s.set_fix_epochs(true);
    s.set_fix_sequences(true);
    s.set_promote(true);
    AddCatchUp(s, 3, 77, v1::AVERAGING_MODE_MEAN);
    s.add_updates()->mutable_caught_up()->set_through(0);
    AddRound(s, 4, 77, 78);
    AddRound(s, 5, 78, 79);
    Write("replica", "catch_up_rounds", s);
  }
  {
    // OUTER_NESTEROV, a round open in the catch-up (one final chunk).
    ReplicaScript s;
    s.set_epoch(2);
    s.set_fix_epochs(true);
    s.set_fix_sequences(true);
    s.set_promote(true);
    AddCatchUp(s, 1, 11, v1::AVERAGING_MODE_OUTER_NESTEROV, /*finals=*/1);
    v1::ReplicaStateChunk* open = s.add_updates()->mutable_state_chunk();
    open->set_job_id("j");
    open->set_index(1);
    open->set_open_round(true);
    open->set_values(Floats(std::vector<float>(4, 2.5f)));
    open->set_momentum(Floats(std::vector<float>(4, 0.25f)));
    open->set_delta(Floats(std::vector<float>(4, 0.5f)));
    s.add_updates()->mutable_caught_up()->set_through(0);
    AddRound(s, 2, 11, 12, /*final_already=*/1);
    AddRound(s, 3, 12, 13);
    Write("replica", "open_round_nesterov", s);
  }
  {
    // OUTER_NESTEROV on the encoded mean (bfloat16, mean encoding wire):
    // two rounds, then chunks of the next whose encoded means are short,
    // not finite, or float32 instead (each refused, a catch-up after it);
    // then the round as it should be.
    ReplicaScript s;
    s.set_epoch(4);
    s.set_fix_epochs(true);
    s.set_fix_sequences(true);
    s.set_promote(true);
    AddCatchUp(s, 1, 21, v1::AVERAGING_MODE_OUTER_NESTEROV, 0,
               /*wire_mean=*/true);
    s.add_updates()->mutable_caught_up()->set_through(0);
    AddRound(s, 2, 21, 22, -1, /*wire_mean=*/true);
    AddRound(s, 3, 22, 23, -1, /*wire_mean=*/true);
    for (const std::string& bad :
         {Bf16s({1, 1, 1}), std::string("\xc0\x7f\xc0\x7f\xc0\x7f\xc0\x7f"),
          std::string()}) {
      v1::ChunkFinal* chunk = s.add_updates()->mutable_chunk();
      chunk->set_job_id("j");
      chunk->set_round(4);
      chunk->set_contributed(true);
      chunk->set_encoded_mean(bad);
      if (bad.empty()) chunk->set_mean(Floats({1, 1, 1, 1}));
      // Refused: the next stream begins with a new catch-up.
      AddCatchUp(s, 3, 23, v1::AVERAGING_MODE_OUTER_NESTEROV, 0,
                 /*wire_mean=*/true);
      s.add_updates()->mutable_caught_up()->set_through(0);
    }
    AddRound(s, 4, 23, 24, -1, /*wire_mean=*/true);
    Write("replica", "encoded_mean_nesterov", s);
  }
  {
    // A job that starts with a replicated seed, then a round.
    ReplicaScript s;
    s.set_epoch(1);
    s.set_fix_epochs(true);
    s.set_fix_sequences(true);
    s.set_promote(true);
    s.add_updates()->mutable_caught_up()->set_through(0);
    v1::StateCommit* seed = s.add_updates()->mutable_commit();
    seed->set_job_id("j");
    seed->set_round(0);
    seed->set_state_id(5);
    seed->set_seed(true);
    seed->set_seed_values(Floats(std::vector<float>(10, 0.5f)));
    FillLayout({6, 4}, seed->mutable_layout());
    ReplicaSettings(seed->mutable_settings(), v1::AVERAGING_MODE_MEAN);
    seed->set_contributor_weight(1);
    AddRound(s, 1, 5, 6);
    Write("replica", "seed_then_round", s);
  }
  {
    // Hostile: non-finite values, wrong sizes, chunks out of order, a
    // round that skips one, an update of a lower epoch, Dropped.
    ReplicaScript s;
    s.set_epoch(9);
    AddCatchUp(s, 3, 77, v1::AVERAGING_MODE_MEAN);
    for (int i = 0; i < s.updates_size(); ++i) {
      s.mutable_updates(i)->set_epoch(9);
      s.mutable_updates(i)->set_sequence(i + 1);
    }
    v1::ReplicaUpdate* nan = s.add_updates();
    nan->set_epoch(9);
    nan->mutable_chunk()->set_job_id("j");
    nan->mutable_chunk()->set_round(4);
    nan->mutable_chunk()->set_contributed(true);
    nan->mutable_chunk()->set_mean(
        Floats({1, std::numeric_limits<float>::quiet_NaN(), 1, 1}));
    AddCatchUp(s, 3, 77, v1::AVERAGING_MODE_MEAN);
    v1::ReplicaUpdate* ragged = s.add_updates();
    ragged->set_epoch(9);
    ragged->mutable_chunk()->set_job_id("j");
    ragged->mutable_chunk()->set_round(4);
    ragged->mutable_chunk()->set_index(7);
    ragged->mutable_chunk()->set_mean("abc");
    AddCatchUp(s, 3, 77, v1::AVERAGING_MODE_MEAN);
    AddRound(s, 6, 77, 80);  // skips round 4
    v1::ReplicaUpdate* old = s.add_updates();
    old->set_epoch(3);
    old->mutable_caught_up();
    s.add_updates()->mutable_dropped()->set_why("fuzz");
    for (int i = 0; i < s.updates_size(); ++i) {
      if (s.updates(i).epoch() == 0) s.mutable_updates(i)->set_epoch(9);
      // Sequences past each catch-up's cut (0): applied, not skipped.
      s.mutable_updates(i)->set_sequence(i + 1);
    }
    Write("replica", "hostile", s);
  }
  {
    // Hostile members: one twice, then one without a well-formed id; each
    // refused with its commit (a new catch-up follows).
    ReplicaScript s;
    s.set_epoch(9);
    s.set_fix_epochs(true);
    s.set_fix_sequences(true);
    s.set_promote(true);
    AddCatchUp(s, 3, 77, v1::AVERAGING_MODE_MEAN);
    AddRound(s, 4, 77, 78);
    v1::StateCommit* twice =
        s.mutable_updates(s.updates_size() - 1)->mutable_commit();
    *twice->add_members() = twice->members(0);
    AddCatchUp(s, 3, 77, v1::AVERAGING_MODE_MEAN);
    AddRound(s, 4, 77, 78);
    s.mutable_updates(s.updates_size() - 1)
        ->mutable_commit()
        ->mutable_members(1)
        ->set_id("not hex");
    Write("replica", "hostile_members", s);
  }
  {
    // Settings that would size an open round's delta at 17 GB: refused
    // before anything is allocated.
    ReplicaScript s;
    s.set_epoch(1);
    s.set_fix_epochs(true);
    s.set_fix_sequences(true);
    v1::JobReplica* job = s.add_updates()->mutable_job();
    job->set_job_id("j");
    FillLayout({2}, job->mutable_layout());
    ReplicaSettings(job->mutable_settings(), v1::AVERAGING_MODE_MEAN);
    job->mutable_settings()->set_chunk_elements(0xffffffffu);
    job->set_has_state(true);
    job->set_round(1);
    job->set_state_id(3);
    job->set_final_chunks(1);
    for (uint32_t c = 0; c < 2; ++c) {
      v1::ReplicaStateChunk* chunk = s.add_updates()->mutable_state_chunk();
      chunk->set_job_id("j");
      chunk->set_index(c);
      chunk->set_values(Floats({1.0f}));
    }
    v1::ReplicaStateChunk* open = s.add_updates()->mutable_state_chunk();
    open->set_job_id("j");
    open->set_index(0);
    open->set_open_round(true);
    open->set_values(Floats({2.0f}));
    open->set_delta(Floats({1.0f}));
    Write("replica", "huge_chunk_elements", s);
  }
}

}  // namespace
}  // namespace fuzz
}  // namespace localsgd

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  localsgd::fuzz::g_dir = argv[1];
  localsgd::fuzz::SyncCorpus();
  localsgd::fuzz::FetchCorpus();
  localsgd::fuzz::JoinCorpus();
  localsgd::fuzz::ReplicaCorpus();
  return 0;
}
