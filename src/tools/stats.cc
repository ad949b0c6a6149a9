#include "tools/stats.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

namespace kvferry::tools {
namespace {

constexpr int kBarWidth = 30;
constexpr auto kTtyInterval = std::chrono::milliseconds(100);
constexpr auto kPlainInterval = std::chrono::seconds(2);

// "12.3 GB/s", decimal units like network and NIC figures.
std::string FormatRate(double bytes_per_second) {
  char buf[32];
  if (bytes_per_second >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.1f GB/s", bytes_per_second / 1e9);
  } else if (bytes_per_second >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.1f MB/s", bytes_per_second / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f KB/s", bytes_per_second / 1e3);
  }
  return buf;
}

// "4s", "2m05s", "1h02m".
std::string FormatSeconds(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%lds", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

size_t DisplayWidth(const std::string& text) {
  // UTF-8 code points: count every byte that is not a continuation byte (10xxxxxx).
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

bool LooksNumeric(const std::string& cell) {
  size_t i = 0;
  if (i < cell.size() && (cell[i] == '-' || cell[i] == '+')) ++i;
  if (i < cell.size() && cell[i] == '.') ++i;
  return i < cell.size() && cell[i] >= '0' && cell[i] <= '9';
}

}  // namespace

void LatencyRecorder::Add(double value) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!samples_.empty() && value < samples_.back()) sorted_ = false;
  samples_.push_back(value);
  sum_ += value;
}

size_t LatencyRecorder::count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return samples_.size();
}

double LatencyRecorder::Percentile(double p) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (samples_.empty()) return 0;
  if (!sorted_) {
    std::sort(samples_.begin(), samples_.end());
    sorted_ = true;
  }
  if (std::isnan(p)) p = 0;
  p = std::clamp(p, 0.0, 100.0);
  const double n = static_cast<double>(samples_.size());
  // ceil(p/100 * n), computed as p*n/100 (exact for integer p) less a hair so that
  // 99.9% of 1000 samples is rank 999 even when 99.9 * 1000 rounds up.
  double rank = std::ceil(p * n / 100.0 - 1e-9);
  rank = std::clamp(rank, 1.0, n);
  return samples_[static_cast<size_t>(rank) - 1];
}

double LatencyRecorder::Mean() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (samples_.empty()) return 0;
  return sum_ / static_cast<double>(samples_.size());
}

ProgressBar::ProgressBar(std::string label, size_t total)
    : label_(std::move(label)),
      total_(total),
      tty_(isatty(STDERR_FILENO) == 1),
      start_(Clock::now()),
      last_draw_(start_) {}

std::string ProgressBar::Render(bool final_line) const {
  const double fraction =
      total_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_));
  const int filled = static_cast<int>(fraction * kBarWidth);
  // Built by appending: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string chains.
  std::string line;
  line.reserve(96);
  line += '[';
  line.append(static_cast<size_t>(filled), '#');
  line.append(static_cast<size_t>(kBarWidth - filled), '.');
  line += "] ";
  line += std::to_string(done_);
  line += '/';
  line += std::to_string(total_);
  if (!label_.empty()) {
    line += ' ';
    line += label_;
  }

  const double elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
  if (bytes_ > 0 && elapsed_s > 0) {
    line += "  ";
    line += FormatRate(static_cast<double>(bytes_) / elapsed_s);
  }
  if (final_line) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "  in %.1fs", elapsed_s);
    line += buf;
  } else if (done_ >= total_) {
    line += "  ETA 0s";
  } else if (done_ == 0) {
    line += "  ETA ?";
  } else {
    const double remaining_s =
        elapsed_s * static_cast<double>(total_ - done_) / static_cast<double>(done_);
    line += "  ETA ";
    line += FormatSeconds(remaining_s);
  }
  return line;
}

void ProgressBar::Update(size_t done, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return;
  // Callers on several threads may report out of order; never move backwards.
  done_ = std::max(done_, done);
  bytes_ = std::max(bytes_, bytes);
  const Clock::time_point now = Clock::now();
  const Clock::duration interval =
      tty_ ? Clock::duration(kTtyInterval) : Clock::duration(kPlainInterval);
  if (now - last_draw_ < interval) return;
  const std::string line = Render(/*final_line=*/false);
  if (tty_) {
    // Pad with spaces so a shorter line fully covers the previous one.
    const std::string pad(last_width_ > line.size() ? last_width_ - line.size() : 0, ' ');
    std::fprintf(stderr, "\r%s%s", line.c_str(), pad.c_str());
    last_width_ = line.size();
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
  last_draw_ = now;
}

void ProgressBar::Finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_) return;
  finished_ = true;
  const std::string line = Render(/*final_line=*/true);
  if (tty_) {
    const std::string pad(last_width_ > line.size() ? last_width_ - line.size() : 0, ' ');
    std::fprintf(stderr, "\r%s%s\n", line.c_str(), pad.c_str());
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

std::string RenderTable(const std::vector<std::vector<std::string>>& rows,
                        bool first_row_is_header) {
  size_t num_columns = 0;
  for (const auto& row : rows) num_columns = std::max(num_columns, row.size());
  if (num_columns == 0) return "";

  std::vector<size_t> width(num_columns, 0);
  std::vector<bool> right_align(num_columns, false);
  std::vector<bool> any_body_cell(num_columns, false);
  std::vector<bool> all_numeric(num_columns, true);
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t c = 0; c < rows[r].size(); ++c) {
      const std::string& cell = rows[r][c];
      width[c] = std::max(width[c], DisplayWidth(cell));
      const bool body = !(first_row_is_header && r == 0);
      // Empty cells and "-" placeholders do not decide a column's alignment.
      if (body && !cell.empty() && cell != "-") {
        any_body_cell[c] = true;
        if (!LooksNumeric(cell)) all_numeric[c] = false;
      }
    }
  }
  for (size_t c = 0; c < num_columns; ++c) right_align[c] = any_body_cell[c] && all_numeric[c];

  static const std::string kEmpty;
  auto render_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < num_columns; ++c) {
      const std::string& cell = c < row.size() ? row[c] : kEmpty;
      const std::string pad(width[c] - DisplayWidth(cell), ' ');
      if (c > 0) line += "  ";
      line += right_align[c] ? pad + cell : cell + pad;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    return line + "\n";
  };

  std::string out;
  for (size_t r = 0; r < rows.size(); ++r) {
    out += render_row(rows[r]);
    if (first_row_is_header && r == 0) {
      std::string rule;
      for (size_t c = 0; c < num_columns; ++c) {
        if (c > 0) rule += "  ";
        rule += std::string(width[c], '-');
      }
      while (!rule.empty() && rule.back() == ' ') rule.pop_back();
      out += rule + "\n";
    }
  }
  return out;
}

}  // namespace kvferry::tools
