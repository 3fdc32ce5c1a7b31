// ThreadSanitizer annotations for Debian's Abseil synchronization library.
//
// Linked into every executable of a LOCALSGD_SANITIZE=thread build (see
// tests/sanitizers/sanitizers.cmake), never into a normal one.
//
// Why: Debian's libabsl_synchronization.so is not built with
// -fsanitize=thread, so ThreadSanitizer never sees absl::Mutex lock or unlock
// and finds no happens-before edge between two critical sections: every
// ABSL_GUARDED_BY member touched from two threads is reported as a race
// (Abseil's own source annotates itself for TSan only when it is compiled
// with it). gRPC's libgpr/libgrpc use absl::Mutex too, through the same
// symbols.
//
// How: this file defines the public absl::Mutex, absl::CondVar,
// absl::Notification, absl::Barrier and absl::BlockingCounter member
// functions that block or release. A definition in the executable wins over
// the shared library's for every caller (our code binds to it at link time;
// the shared libraries, Abseil itself included, reach it through the PLT).
// Each one tells TSan what happens (the __tsan_mutex_* annotations Abseil
// uses when built with TSan, same flags and order) and forwards to the real
// function, found with dlsym(RTLD_NEXT). Between pre_lock/post_lock and
// pre_unlock/post_unlock TSan ignores memory accesses, so absl::Condition
// callbacks that Abseil evaluates inside Lock/Unlock/Await (possibly on
// another thread, while the mutex is held) are not reported.
//
// Not covered: absl::Notification::HasBeenNotified() is inline (an atomic
// load whose store TSan never sees), so waiting by polling it gives no
// happens-before edge; WaitForNotification*() does.

#if defined(__SANITIZE_THREAD__)
#define LOCALSGD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LOCALSGD_TSAN 1
#endif
#endif
#ifndef LOCALSGD_TSAN
#error "tsan_absl_mutex.cc is for -fsanitize=thread builds only"
#endif

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/base/options.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

static_assert(ABSL_OPTION_USE_INLINE_NAMESPACE == 1,
              "the mangled names below assume Abseil's inline namespace");

namespace {

#define LOCALSGD_TSAN_STR2(x) #x
#define LOCALSGD_TSAN_STR(x) LOCALSGD_TSAN_STR2(x)
constexpr char kInlineNamespace[] =
    LOCALSGD_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);

// The shared library's definition of absl::<ns>::<suffix> (an Itanium
// mangled name without the "_ZN[K]4absl<len><ns>" prefix). Aborts if it is
// missing: a silently unannotated mutex would mean false reports.
void* Real(bool is_const, const char* suffix) {
  char name[256];
  std::snprintf(name, sizeof(name), "%s%zu%s%s",
                is_const ? "_ZNK4absl" : "_ZN4absl",
                sizeof(kInlineNamespace) - 1, kInlineNamespace, suffix);
  void* fn = dlsym(RTLD_NEXT, name);
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found: %s\n", name,
                 dlerror());
    std::abort();
  }
  return fn;
}

// absl::Mutex is one word, and kMuWriter (0x0008, absl/synchronization/
// mutex.cc) is set while it is held exclusively: Await and CondVar::Wait
// release and retake the mutex in the mode it is held in, and the
// annotations must name that mode.
unsigned HeldMode(const absl::Mutex* mu) {
  static_assert(sizeof(absl::Mutex) == sizeof(std::atomic<intptr_t>),
                "absl::Mutex layout changed");
  constexpr intptr_t kMuWriter = 0x0008;
  intptr_t v = reinterpret_cast<const std::atomic<intptr_t>*>(mu)->load(
      std::memory_order_relaxed);
  return (v & kMuWriter) != 0 ? 0 : __tsan_mutex_read_lock;
}

// Some real functions call others through the PLT (AwaitWithTimeout calls
// AwaitWithDeadline, ...), which lands in this file again: only the
// outermost absl::Mutex/CondVar call on a thread is annotated.
thread_local int tls_depth = 0;

class Nesting {
 public:
  Nesting() : outermost_(tls_depth++ == 0) {}
  ~Nesting() { --tls_depth; }
  Nesting(const Nesting&) = delete;
  Nesting& operator=(const Nesting&) = delete;
  bool outermost() const { return outermost_; }

 private:
  const bool outermost_;
};

// Lock/ReaderLock/LockWhen*: take `mu` in `mode`.
template <typename F>
auto Locking(absl::Mutex* mu, unsigned mode, F&& lock) {
  Nesting nesting;
  if (!nesting.outermost()) return lock();
  __tsan_mutex_pre_lock(mu, mode);
  auto result = lock();
  __tsan_mutex_post_lock(mu, mode, 0);
  return result;
}

// TryLock/ReaderTryLock: `mode` includes __tsan_mutex_try_lock.
template <typename F>
bool TryLocking(absl::Mutex* mu, unsigned mode, F&& try_lock) {
  Nesting nesting;
  if (!nesting.outermost()) return try_lock();
  __tsan_mutex_pre_lock(mu, mode);
  bool locked = try_lock();
  __tsan_mutex_post_lock(
      mu, locked ? mode : mode | __tsan_mutex_try_lock_failed, 0);
  return locked;
}

// Unlock/ReaderUnlock.
template <typename F>
void Unlocking(absl::Mutex* mu, unsigned mode, F&& unlock) {
  Nesting nesting;
  if (!nesting.outermost()) return unlock();
  __tsan_mutex_pre_unlock(mu, mode);
  unlock();
  __tsan_mutex_post_unlock(mu, mode);
}

// Await*/CondVar::Wait*: release `mu` (held in the mode it is held in),
// block, retake it.
template <typename F>
auto ReleaseAndRetake(absl::Mutex* mu, F&& wait) {
  Nesting nesting;
  if (!nesting.outermost()) return wait();
  const unsigned mode = HeldMode(mu);
  __tsan_mutex_pre_unlock(mu, mode);
  auto result = wait();
  __tsan_mutex_post_unlock(mu, mode);
  __tsan_mutex_pre_lock(mu, mode);
  __tsan_mutex_post_lock(mu, mode, 0);
  return result;
}

}  // namespace

// Resolved once per function, on first use (shared libraries may lock before
// this executable's static initializers run).
#define LOCALSGD_REAL(is_const, suffix, ...)                      \
  static const auto real = reinterpret_cast<__VA_ARGS__>(         \
      Real(is_const, suffix))

namespace absl {
ABSL_NAMESPACE_BEGIN

// The inline constructor (mutex.h) announces the mutex to TSan when our code
// is compiled with it; this forgets it, as Abseil's own destructor does in a
// TSan build.
Mutex::~Mutex() {
  LOCALSGD_REAL(false, "5MutexD2Ev", void (*)(Mutex*));
  __tsan_mutex_destroy(this, __tsan_mutex_not_static);
  real(this);
}

void Mutex::Lock() {
  LOCALSGD_REAL(false, "5Mutex4LockEv", void (*)(Mutex*));
  Locking(this, 0, [&] { return (real(this), 0); });
}

void Mutex::ReaderLock() {
  LOCALSGD_REAL(false, "5Mutex10ReaderLockEv", void (*)(Mutex*));
  Locking(this, __tsan_mutex_read_lock, [&] { return (real(this), 0); });
}

bool Mutex::TryLock() {
  LOCALSGD_REAL(false, "5Mutex7TryLockEv", bool (*)(Mutex*));
  return TryLocking(this, __tsan_mutex_try_lock, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  LOCALSGD_REAL(false, "5Mutex13ReaderTryLockEv", bool (*)(Mutex*));
  return TryLocking(this, __tsan_mutex_try_read_lock,
                    [&] { return real(this); });
}

void Mutex::Unlock() {
  LOCALSGD_REAL(false, "5Mutex6UnlockEv", void (*)(Mutex*));
  Unlocking(this, 0, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  LOCALSGD_REAL(false, "5Mutex12ReaderUnlockEv", void (*)(Mutex*));
  Unlocking(this, __tsan_mutex_read_lock, [&] { real(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  LOCALSGD_REAL(false, "5Mutex8LockWhenERKNS0_9ConditionE",
                void (*)(Mutex*, const Condition&));
  Locking(this, 0, [&] { return (real(this, cond), 0); });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  LOCALSGD_REAL(false, "5Mutex14ReaderLockWhenERKNS0_9ConditionE",
                void (*)(Mutex*, const Condition&));
  Locking(this, __tsan_mutex_read_lock, [&] { return (real(this, cond), 0); });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  LOCALSGD_REAL(false,
                "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE",
                bool (*)(Mutex*, const Condition&, Duration));
  return Locking(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond,
                                      Duration timeout) {
  LOCALSGD_REAL(
      false,
      "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE",
      bool (*)(Mutex*, const Condition&, Duration));
  return Locking(this, __tsan_mutex_read_lock,
                 [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  LOCALSGD_REAL(false,
                "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE",
                bool (*)(Mutex*, const Condition&, Time));
  return Locking(this, 0, [&] { return real(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  LOCALSGD_REAL(
      false, "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE",
      bool (*)(Mutex*, const Condition&, Time));
  return Locking(this, __tsan_mutex_read_lock,
                 [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  LOCALSGD_REAL(false, "5Mutex5AwaitERKNS0_9ConditionE",
                void (*)(Mutex*, const Condition&));
  ReleaseAndRetake(this, [&] { return (real(this, cond), 0); });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  LOCALSGD_REAL(false,
                "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE",
                bool (*)(Mutex*, const Condition&, Duration));
  return ReleaseAndRetake(this,
                          [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  LOCALSGD_REAL(false, "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE",
                bool (*)(Mutex*, const Condition&, Time));
  return ReleaseAndRetake(this,
                          [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  LOCALSGD_REAL(false, "7CondVar4WaitEPNS0_5MutexE",
                void (*)(CondVar*, Mutex*));
  ReleaseAndRetake(mu, [&] { return (real(this, mu), 0); });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  LOCALSGD_REAL(false, "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE",
                bool (*)(CondVar*, Mutex*, Duration));
  return ReleaseAndRetake(mu,
                          [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  LOCALSGD_REAL(false, "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE",
                bool (*)(CondVar*, Mutex*, Time));
  return ReleaseAndRetake(mu,
                          [&] { return real(this, mu, deadline); });
}

// Notification, Barrier, BlockingCounter: a release before the call that
// publishes, an acquire after the one that observes (their fast paths read
// an atomic inside the uninstrumented library, which TSan does not see).
void Notification::Notify() {
  LOCALSGD_REAL(false, "12Notification6NotifyEv", void (*)(Notification*));
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  LOCALSGD_REAL(true, "12Notification19WaitForNotificationEv",
                void (*)(const Notification*));
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  LOCALSGD_REAL(true,
                "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE",
                bool (*)(const Notification*, Duration));
  bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  LOCALSGD_REAL(true,
                "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE",
                bool (*)(const Notification*, Time));
  bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Barrier::Block() {
  LOCALSGD_REAL(false, "7Barrier5BlockEv", bool (*)(Barrier*));
  __tsan_release(this);
  bool last = real(this);
  __tsan_acquire(this);
  return last;
}

bool BlockingCounter::DecrementCount() {
  LOCALSGD_REAL(false, "15BlockingCounter14DecrementCountEv",
                bool (*)(BlockingCounter*));
  __tsan_release(this);
  bool last = real(this);
  if (last) __tsan_acquire(this);
  return last;
}

void BlockingCounter::Wait() {
  LOCALSGD_REAL(false, "15BlockingCounter4WaitEv", void (*)(BlockingCounter*));
  real(this);
  __tsan_acquire(this);
}

ABSL_NAMESPACE_END
}  // namespace absl
