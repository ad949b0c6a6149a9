#include "kvferry/faults.h"

#include <charconv>
#include <cmath>
#include <string>
#include <vector>

namespace kvferry {
namespace {

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string_view::npos) end = s.size();
    parts.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

Status Bad(std::string_view key, std::string_view value, std::string_view why) {
  return InvalidArgumentError("fault plan: " + std::string(key) + "=" + std::string(value) + ": " +
                              std::string(why));
}

StatusOr<int64_t> Count(std::string_view key, std::string_view value) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size() || value.empty()) {
    return Bad(key, value, "not an integer");
  }
  if (v < 0) return Bad(key, value, "must not be negative");
  return v;
}

StatusOr<double> Probability(std::string_view key, std::string_view value) {
  double v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size() || value.empty()) {
    return Bad(key, value, "not a number");
  }
  if (!(v >= 0.0 && v <= 1.0)) return Bad(key, value, "a probability must be in [0, 1]");
  return v;
}

std::string Number(double v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, ec == std::errc() ? end : buf);
}

}  // namespace

bool FaultPlan::active() const {
  return drop > 0 || fail > 0 || corrupt > 0 || delay.count() > 0 || fail_after >= 0 ||
         stall_after >= 0 || partition_length.count() > 0;
}

std::string FaultPlan::ToString() const {
  if (!active()) return "";
  std::string s = "seed=" + std::to_string(seed);
  if (!(on_write && on_read && on_notify)) {
    std::string ops;
    if (on_write) ops += "+write";
    if (on_read) ops += "+read";
    if (on_notify) ops += "+notify";
    s += ",ops=" + (ops.empty() ? std::string() : ops.substr(1));
  }
  if (drop > 0) s += ",drop=" + Number(drop);
  if (fail > 0) s += ",fail=" + Number(fail);
  if (corrupt > 0) s += ",corrupt=" + Number(corrupt);
  if (delay.count() > 0) s += ",delay_us=" + std::to_string(delay.count());
  if (fail_after >= 0) s += ",fail_after=" + std::to_string(fail_after);
  if (stall_after >= 0) s += ",stall_after=" + std::to_string(stall_after);
  if (partition_length.count() > 0) {
    s += ",partition=" + std::to_string(partition_start.count()) + "+" +
         std::to_string(partition_length.count());
  }
  return s;
}

StatusOr<FaultPlan> ParseFaultPlan(std::string_view spec) {
  FaultPlan plan;
  plan.stats = std::make_shared<FaultStats>();
  if (spec.empty()) return plan;
  for (std::string_view entry : Split(spec, ',')) {
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError("fault plan: '" + std::string(entry) +
                                  "' is not key=value (e.g. drop=0.01)");
    }
    const std::string_view key = entry.substr(0, eq);
    const std::string_view value = entry.substr(eq + 1);
    if (key == "seed") {
      auto v = Count(key, value);
      if (!v.ok()) return v.status();
      plan.seed = static_cast<uint64_t>(*v);
    } else if (key == "ops") {
      plan.on_write = plan.on_read = plan.on_notify = false;
      for (std::string_view op : Split(value, '+')) {
        if (op == "write") {
          plan.on_write = true;
        } else if (op == "read") {
          plan.on_read = true;
        } else if (op == "notify") {
          plan.on_notify = true;
        } else {
          return Bad(key, value, "unknown op '" + std::string(op) + "' (write, read, notify)");
        }
      }
    } else if (key == "drop" || key == "fail" || key == "corrupt") {
      auto v = Probability(key, value);
      if (!v.ok()) return v.status();
      (key == "drop" ? plan.drop : key == "fail" ? plan.fail : plan.corrupt) = *v;
    } else if (key == "delay_us") {
      auto v = Count(key, value);
      if (!v.ok()) return v.status();
      plan.delay = std::chrono::microseconds(*v);
    } else if (key == "fail_after" || key == "stall_after") {
      auto v = Count(key, value);
      if (!v.ok()) return v.status();
      (key == "fail_after" ? plan.fail_after : plan.stall_after) = *v;
    } else if (key == "partition") {
      const size_t plus = value.find('+');
      if (plus == std::string_view::npos) {
        return Bad(key, value, "expected START_MS+LENGTH_MS");
      }
      auto start = Count(key, value.substr(0, plus));
      if (!start.ok()) return start.status();
      auto length = Count(key, value.substr(plus + 1));
      if (!length.ok()) return length.status();
      plan.partition_start = std::chrono::milliseconds(*start);
      plan.partition_length = std::chrono::milliseconds(*length);
    } else {
      return InvalidArgumentError(
          "fault plan: unknown key '" + std::string(key) +
          "' (seed, ops, drop, fail, corrupt, delay_us, fail_after, stall_after, partition)");
    }
  }
  if (plan.drop + plan.fail > 1.0) {
    return InvalidArgumentError("fault plan: drop + fail exceeds 1 (" + Number(plan.drop) + " + " +
                                Number(plan.fail) + ")");
  }
  return plan;
}

}  // namespace kvferry
