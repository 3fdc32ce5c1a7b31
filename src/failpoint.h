// Failpoints: named places in the coordinator where a test can have the
// process kill itself, so that a crash lands at a chosen moment (between two
// result chunks of a round, during a standby's catch-up) instead of wherever
// a SIGKILL from outside happens to find it. The fault tests of the standby
// coordinators (tests/ha/failover_test.cc) use them; nothing else should.
//
// Off unless the environment names a file: LOCALSGD_FAILPOINTS=<path>. Then
// Reload() (the server's tick thread calls it every tick) reads the file, one
// failpoint name per line, and Hit() of an armed failpoint logs and raises
// SIGKILL: the process ends as a killed one does, with nothing flushed or
// closed. The file may change while the process runs; a test arms a
// failpoint once the moment is near. An unknown name in the file is logged
// and ignored.
//
// Thread-safety: Hit() is lock-free (one atomic load when off or unarmed)
// and never blocks, so gRPC callback handlers may call it; Reload() does
// file I/O and belongs on a plain thread.
#ifndef LOCALSGD_SRC_FAILPOINT_H_
#define LOCALSGD_SRC_FAILPOINT_H_

namespace localsgd {

enum class Failpoint {
  // A Sync stream of the primary took a contribution chunk (members are
  // uploading).
  kContributionChunk,
  // A Sync stream of the primary wrote a result chunk to its member (more
  // may follow: members hold part of a round's result).
  kResultChunkSent,
  // A round closed (its record logged; its result may or may not have
  // reached members yet).
  kRoundClosed,
  // The primary wrote one message of a standby's catch-up.
  kCatchUpSent,
};

// The name a failpoints file uses: "contribution_chunk",
// "result_chunk_sent", "round_closed", "catch_up_sent".
const char* FailpointName(Failpoint failpoint);

// Whether LOCALSGD_FAILPOINTS is set (read once).
bool FailpointsEnabled();

// Re-reads the file named by LOCALSGD_FAILPOINTS; nothing if unset. An
// unreadable or missing file disarms every failpoint.
void ReloadFailpoints();

// Kills this process (SIGKILL, after a log line) if `failpoint` is armed.
void HitFailpoint(Failpoint failpoint);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_FAILPOINT_H_
