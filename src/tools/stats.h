// Summary statistics and console output for the `kvferry` tools: latency percentiles, a
// progress bar on stderr and aligned text tables.
//
// Thread-safety: LatencyRecorder and ProgressBar may be used from several threads at once
// (each guards its state with its own mutex). RenderTable is a pure function.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace kvferry::tools {

// Collects samples (any unit; callers name it, e.g. latency_us) and answers percentiles.
// Keeps every sample: 8 bytes each, fine for the ~10^6 requests of a replay.
class LatencyRecorder {
 public:
  // Adds one sample. Thread-safe, O(1) amortized.
  void Add(double value);
  // Number of samples added so far.
  size_t count() const;
  // Nearest-rank percentile: the smallest sample such that at least p% of the samples are
  // <= it (sample number ceil(p/100 * count) of the sorted samples, at least the first).
  // p is clamped to [0, 100]; Percentile(0) is the minimum, Percentile(100) the maximum.
  // Returns 0 when empty. Sorts the samples on the first call after an Add (O(n log n)).
  double Percentile(double p) const;
  // Arithmetic mean; 0 when empty.
  double Mean() const;

 private:
  mutable std::mutex mutex_;
  mutable std::vector<double> samples_;  // guarded by mutex_
  mutable bool sorted_ = true;           // guarded by mutex_
  double sum_ = 0;                       // guarded by mutex_
};

// Progress on stderr, e.g. "[#####.....] 37/100 requests  12.3 GB/s  ETA 4s".
// On a terminal it redraws one line in place at most every 100 ms; when stderr is not a
// terminal (a log file, CI) it prints a plain line at most every 2 s instead. The first draw
// waits one interval after construction, so the rate (bytes over wall time since
// construction) and the ETA (average pace so far holds) rest on some data, and a run
// shorter than that prints only Finish's line.
class ProgressBar {
 public:
  // `label` names the unit counted ("requests"); `total` is the count at completion.
  ProgressBar(std::string label, size_t total);

  // Reports cumulative progress: `done` items and `bytes` moved so far (totals, not
  // increments). Thread-safe; draws only when the redraw interval has passed, so it is cheap
  // to call per item.
  void Update(size_t done, uint64_t bytes);

  // Draws the final state with the elapsed time and ends the line. Later calls (and later
  // Updates) do nothing.
  void Finish();

 private:
  using Clock = std::chrono::steady_clock;
  std::string Render(bool final_line) const;  // REQUIRES: mutex_ held

  const std::string label_;
  const size_t total_;
  const bool tty_;
  const Clock::time_point start_;

  std::mutex mutex_;
  size_t done_ = 0;              // guarded by mutex_
  uint64_t bytes_ = 0;           // guarded by mutex_
  bool finished_ = false;        // guarded by mutex_
  size_t last_width_ = 0;        // guarded by mutex_: chars of the last in-place line
  Clock::time_point last_draw_;  // guarded by mutex_
};

// Renders rows as a text table with aligned columns, two spaces between columns and lines
// ending in '\n' (no trailing spaces). Rows may have different lengths (missing cells are
// empty). Columns whose body cells are all numbers ("12.3", "-4", "7 ms", "1.5 GiB/s":
// leading digit, sign or dot followed by a number) are right-aligned; others left-aligned.
// With `first_row_is_header`, a line of dashes under the first row separates it from the
// body and the header cell follows its column's alignment. Widths count UTF-8 code points.
std::string RenderTable(const std::vector<std::vector<std::string>>& rows,
                        bool first_row_is_header = true);

}  // namespace kvferry::tools
