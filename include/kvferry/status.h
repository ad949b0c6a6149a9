// Status and StatusOr: how every kvferry host API reports failure.
//
// kvferry's core never throws. A call that can fail returns a Status (or StatusOr<T> when it
// also produces a value). Codes are chosen by what the caller should do next, following the
// canonical codes of abseil's absl/status/status.h:
//   kInvalidArgument     the arguments are wrong whatever the system state (fix the call)
//   kFailedPrecondition  the system is not in a state for this (e.g. address not registered)
//   kNotFound            a named thing (segment, batch, room) does not exist
//   kAlreadyExists       a thing with that id exists (e.g. a duplicate bootstrap room)
//   kResourceExhausted   a queue, pool or ring is full; retry later or with less
//   kUnavailable         the peer is gone or unreachable; retry may succeed after it returns
//   kDeadlineExceeded    the operation's deadline passed before it finished
//   kCancelled           the caller cancelled it
//   kAborted             the peer aborted it
//   kDataLoss            bytes arrived but are not what was sent (verification, corruption)
//   kOutOfRange          an offset or length lies outside a valid range
//   kUnimplemented       not supported by this build or transport
//   kInternal            a kvferry bug or an unexpected system error
//
// Thread-safety: Status and StatusOr are values; distinct objects may be used from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvferry {

enum class StatusCode : uint8_t {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

// Number of codes: arrays indexed by StatusCode (e.g. counters by code) have this size.
inline constexpr size_t kNumStatusCodes = static_cast<size_t>(StatusCode::kDataLoss) + 1;

// Returns the canonical upper-case name, e.g. "DEADLINE_EXCEEDED".
std::string_view StatusCodeName(StatusCode code);

// Maps a wire value back to a code; unknown values become kUnknown.
StatusCode StatusCodeFromInt(uint32_t value);

// An error code and message, or OK. OK is a null pointer (no allocation, cheap to make, copy
// and destroy: every request of a batch carries one); an error holds its code and message in
// one heap block, copied deeply.
class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) {
    if (code != StatusCode::kOk) rep_ = std::make_unique<Rep>(Rep{code, std::move(message)});
  }
  Status(const Status& other)
      : rep_(other.rep_ == nullptr ? nullptr : std::make_unique<Rep>(*other.rep_)) {}
  Status& operator=(const Status& other) {
    if (this != &other) rep_ = other.rep_ == nullptr ? nullptr : std::make_unique<Rep>(*other.rep_);
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ == nullptr ? StatusCode::kOk : rep_->code; }
  // Empty for OK.
  const std::string& message() const;
  // "OK" or "CODE_NAME: message".
  std::string ToString() const;

  // Returns a copy whose message is "context: message" (code unchanged; OK stays OK).
  Status WithContext(std::string_view context) const;

  // Explicitly discards a status where ignoring it is deliberate (e.g. best-effort cleanup).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

inline Status OkStatus() { return Status(); }
inline Status CancelledError(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status InvalidArgumentError(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status DeadlineExceededError(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExistsError(std::string m) {
  return {StatusCode::kAlreadyExists, std::move(m)};
}
inline Status PermissionDeniedError(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}
inline Status ResourceExhaustedError(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status FailedPreconditionError(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status AbortedError(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status OutOfRangeError(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status UnimplementedError(std::string m) {
  return {StatusCode::kUnimplemented, std::move(m)};
}
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }

// Either a value or a non-OK Status. Accessing value() of an error is a programming error
// (checked: it aborts with the status message).
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : rep_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(rep_).ok()) rep_ = Status(StatusCode::kInternal, "OK status in StatusOr");
  }
  StatusOr(T value) : rep_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(rep_); }
  Status status() const { return ok() ? Status() : std::get<Status>(rep_); }

  T& value() & {
    CheckOk();
    return std::get<T>(rep_);
  }
  const T& value() const& {
    CheckOk();
    return std::get<T>(rep_);
  }
  T&& value() && {
    CheckOk();
    return std::get<T>(std::move(rep_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void CheckOk() const;
  std::variant<Status, T> rep_;
};

namespace internal {
[[noreturn]] void DieOnBadStatusOrAccess(const Status& status);
}  // namespace internal

template <typename T>
void StatusOr<T>::CheckOk() const {
  if (!ok()) internal::DieOnBadStatusOrAccess(std::get<Status>(rep_));
}

}  // namespace kvferry
