#include "src/outlier_guard.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/median.h"

namespace localsgd {

OutlierGuard::OutlierGuard(uint32_t num_chunks, float ratio)
    : ratio_(ratio > 0 ? ratio : 0),
      history_(enabled() ? num_chunks : 0),
      next_(enabled() ? num_chunks : 0, 0) {}

double OutlierGuard::Center(uint32_t c) const {
  if (!enabled()) return 0;
  return Median(history_[c]);
}

std::string OutlierGuard::Why(uint32_t c, double norm, double center,
                              size_t over) const {
  return absl::StrFormat(
      "chunk %d has an L2 norm of %.4g, %.3g times the median %.4g of %d "
      "recent contributions of that chunk (the outlier guard refuses more "
      "than %g times)",
      c, norm, norm / center, center, over, ratio_);
}

OutlierGuard::Verdict OutlierGuard::Judge(uint32_t c, double norm,
                                          std::string* why) const {
  // A zero delta cannot be an outlier, and says nothing of the scale.
  if (!enabled() || norm == 0) return Verdict::kAccept;
  const std::vector<double>& known = history_[c];
  if (known.size() < kMinReference) return Verdict::kHold;
  const double center = Median(known);
  // Negated so that a NaN norm (never: payloads are finite) is refused.
  if (!(norm <= ratio_ * center)) {
    *why = Why(c, norm, center, known.size());
    return Verdict::kReject;
  }
  return Verdict::kAccept;
}

void OutlierGuard::Accept(uint32_t c, double norm) {
  if (!enabled() || norm == 0) return;
  std::vector<double>& ring = history_[c];
  if (ring.size() < kHistory) {
    ring.push_back(norm);
    return;
  }
  ring[next_[c]] = norm;
  next_[c] = static_cast<uint8_t>((next_[c] + 1) % kHistory);
}

void OutlierGuard::Hold(uint32_t c, const MemberId& member,
                        absl::Span<const absl::string_view> pieces,
                        double norm) {
  Held h;
  h.member = member;
  h.norm = norm;
  size_t size = 0;
  for (absl::string_view piece : pieces) size += piece.size();
  h.bytes.reserve(size);
  for (absl::string_view piece : pieces) {
    h.bytes.append(piece.data(), piece.size());
  }
  held_bytes_ += h.bytes.size();
  held_[c].push_back(std::move(h));
}

bool OutlierGuard::Due(uint32_t c) const {
  auto it = held_.find(c);
  const size_t held = it == held_.end() ? 0 : it->second.size();
  return held > 0 && history_[c].size() + held >= kMinReference;
}

bool OutlierGuard::Holds(uint32_t c, const MemberId& member) const {
  auto it = held_.find(c);
  if (it == held_.end()) return false;
  for (const Held& h : it->second) {
    if (h.member == member) return true;
  }
  return false;
}

std::vector<uint32_t> OutlierGuard::HeldChunks() const {
  std::vector<uint32_t> chunks;
  chunks.reserve(held_.size());
  for (const auto& [c, held] : held_) chunks.push_back(c);
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

std::vector<OutlierGuard::Judged> OutlierGuard::Release(uint32_t c) {
  std::vector<Judged> out;
  auto it = held_.find(c);
  if (it == held_.end()) return out;
  std::vector<Held> held = std::move(it->second);
  held_.erase(it);
  std::vector<double> reference = history_[c];
  for (const Held& h : held) reference.push_back(h.norm);
  const size_t over = reference.size();
  // Fewer than kMinReference: accepted (nothing says which is the outlier).
  const double center = Median(std::move(reference));
  for (Held& h : held) {
    held_bytes_ -= h.bytes.size();
    Judged j;
    j.member = h.member;
    j.norm = h.norm;
    j.accepted = over < kMinReference || h.norm <= ratio_ * center;
    if (j.accepted) {
      Accept(c, h.norm);
    } else {
      j.why = Why(c, h.norm, center, over);
    }
    j.bytes = std::move(h.bytes);
    out.push_back(std::move(j));
  }
  return out;
}

void OutlierGuard::Forget(const MemberId& member) {
  for (auto it = held_.begin(); it != held_.end();) {
    std::vector<Held>& held = it->second;
    for (auto h = held.begin(); h != held.end();) {
      if (h->member == member) {
        held_bytes_ -= h->bytes.size();
        h = held.erase(h);
      } else {
        ++h;
      }
    }
    if (held.empty()) {
      held_.erase(it++);
    } else {
      ++it;
    }
  }
}

void OutlierGuard::DropHeld() {
  held_.clear();
  held_bytes_ = 0;
}

bool OutlierGuard::RoundClosed(uint32_t refused, uint32_t counted) {
  DropHeld();
  if (!enabled() || refused <= counted) return false;
  Reset();
  return true;
}

void OutlierGuard::Reset() {
  held_.clear();
  held_bytes_ = 0;
  for (std::vector<double>& ring : history_) ring.clear();
  std::fill(next_.begin(), next_.end(), 0);
}

}  // namespace localsgd
