// Trace reader on the real Mooncake conversation trace and on broken files; synthetic traces.
#include "tools/trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace kvferry::tools {
namespace {

const std::string kConversationTrace =
    std::string(KVFERRY_SOURCE_DIR) + "/../shared/traces/conversation_trace.jsonl";

// A temporary file removed when the test ends.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    path_ = (std::filesystem::temp_directory_path() /
             ("kvferry_trace_test_" + std::to_string(getpid()) + "_" + std::to_string(counter_++) +
              ".jsonl"))
                .string();
    std::ofstream(path_) << contents;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

constexpr char kGoodLine[] =
    R"({"timestamp": 10, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2]})";

TEST(TraceTest, LoadsConversationTraceWithLimit) {
  if (!std::filesystem::exists(kConversationTrace)) {
    GTEST_SKIP() << "no trace at " << kConversationTrace;
  }
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(kConversationTrace, 100);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_EQ(trace->size(), 100u);
  const TraceRequest& first = trace->front();
  EXPECT_EQ(first.timestamp_ms, 0);
  EXPECT_EQ(first.input_length, 6758);
  EXPECT_EQ(first.output_length, 500);
  EXPECT_EQ(first.num_hash_ids, 14);  // ceil(6758 / 512)
  EXPECT_EQ(first.line, 1u);
  EXPECT_EQ(trace->back().line, 100u);
  EXPECT_TRUE(std::is_sorted(trace->begin(), trace->end(),
                             [](const TraceRequest& a, const TraceRequest& b) {
                               return a.timestamp_ms < b.timestamp_ms;
                             }));
  for (const TraceRequest& r : *trace) {
    EXPECT_EQ(r.num_hash_ids, (r.input_length + 511) / 512) << "line " << r.line;
  }
}

TEST(TraceTest, LoadsWholeConversationTrace) {
  if (!std::filesystem::exists(kConversationTrace)) {
    GTEST_SKIP() << "no trace at " << kConversationTrace;
  }
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(kConversationTrace, 0);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->size(), 12031u);
  double sum = 0;
  for (const TraceRequest& r : *trace) sum += static_cast<double>(r.input_length);
  EXPECT_NEAR(sum / static_cast<double>(trace->size()), 12035, 1);  // README's average
}

TEST(TraceTest, SkipsBlankLinesAndKeepsLineNumbers) {
  TempFile file(std::string(kGoodLine) + "\n\n   \n" + kGoodLine + "\r\n");
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(file.path(), 0);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_EQ(trace->size(), 2u);
  EXPECT_EQ((*trace)[0].line, 1u);
  EXPECT_EQ((*trace)[1].line, 4u);
  EXPECT_EQ((*trace)[1].timestamp_ms, 10);
  EXPECT_EQ((*trace)[1].input_length, 1000);
  EXPECT_EQ((*trace)[1].output_length, 20);
  EXPECT_EQ((*trace)[1].num_hash_ids, 2);
}

TEST(TraceTest, MalformedJsonNamesFileAndLine) {
  TempFile file(std::string(kGoodLine) + "\n" + kGoodLine + "\n{\"timestamp\": 5, \"input_len\n");
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(file.path(), 0);
  EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument);
  const std::string message = trace.status().message();
  EXPECT_NE(message.find(file.path() + ":3:"), std::string::npos) << message;
  EXPECT_NE(message.find("not JSON"), std::string::npos) << message;

  // With a limit that stops before the broken line, the file loads.
  StatusOr<std::vector<TraceRequest>> head = LoadTrace(file.path(), 2);
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  EXPECT_EQ(head->size(), 2u);
}

TEST(TraceTest, MissingFieldIsNamed) {
  TempFile file(std::string(kGoodLine) + "\n" +
                R"({"timestamp": 10, "output_length": 20, "hash_ids": []})" + "\n");
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(file.path(), 0);
  EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(trace.status().message(), file.path() + ":2: missing field 'input_length'");
}

TEST(TraceTest, NegativeOrZeroLengthsAreRejected) {
  TempFile negative(R"({"timestamp": 0, "input_length": -5, "output_length": 1})");
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(negative.path(), 0);
  EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(trace.status().message().find(":1: input_length must be > 0, got -5"),
            std::string::npos)
      << trace.status().message();

  TempFile zero(R"({"timestamp": 0, "input_length": 0, "output_length": 1})");
  EXPECT_EQ(LoadTrace(zero.path(), 0).status().code(), StatusCode::kInvalidArgument);

  TempFile output(R"({"timestamp": 0, "input_length": 8, "output_length": -1})");
  trace = LoadTrace(output.path(), 0);
  EXPECT_NE(trace.status().message().find("output_length must be >= 0"), std::string::npos)
      << trace.status().message();

  TempFile mistyped(R"({"timestamp": 0, "input_length": "8", "output_length": 1})");
  trace = LoadTrace(mistyped.path(), 0);
  EXPECT_NE(trace.status().message().find("'input_length' must be an integer"), std::string::npos)
      << trace.status().message();

  TempFile not_object("[1, 2, 3]\n");
  trace = LoadTrace(not_object.path(), 0);
  EXPECT_NE(trace.status().message().find(":1: not a JSON object"), std::string::npos)
      << trace.status().message();
}

TEST(TraceTest, FloatTimestampsAreRounded) {
  TempFile file(R"({"timestamp": 12.6, "input_length": 8, "output_length": 1})");
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(file.path(), 0);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->at(0).timestamp_ms, 13);
  EXPECT_EQ(trace->at(0).num_hash_ids, 0);  // no hash_ids field
}

TEST(TraceTest, MissingFileIsNotFound) {
  const std::string path = "/nonexistent/kvferry/no_such_trace.jsonl";
  StatusOr<std::vector<TraceRequest>> trace = LoadTrace(path, 0);
  EXPECT_EQ(trace.status().code(), StatusCode::kNotFound);
  EXPECT_NE(trace.status().message().find(path), std::string::npos);
}

TEST(TraceTest, SyntheticIsDeterministicPerSeed) {
  const std::vector<TraceRequest> a = SyntheticTrace(500, 42);
  const std::vector<TraceRequest> b = SyntheticTrace(500, 42);
  const std::vector<TraceRequest> c = SyntheticTrace(500, 43);
  ASSERT_EQ(a.size(), 500u);
  ASSERT_EQ(b.size(), 500u);
  bool all_equal = true;
  bool differs_from_c = false;
  for (size_t i = 0; i < a.size(); ++i) {
    all_equal &= a[i].timestamp_ms == b[i].timestamp_ms && a[i].input_length == b[i].input_length &&
                 a[i].output_length == b[i].output_length;
    differs_from_c |= a[i].input_length != c[i].input_length;
  }
  EXPECT_TRUE(all_equal);
  EXPECT_TRUE(differs_from_c);
  EXPECT_TRUE(SyntheticTrace(0, 1).empty());
}

TEST(TraceTest, SyntheticResemblesConversationTrace) {
  const size_t n = 20000;
  const std::vector<TraceRequest> trace = SyntheticTrace(n, 7);
  ASSERT_EQ(trace.size(), n);
  EXPECT_EQ(trace.front().timestamp_ms, 0);
  double sum = 0;
  int64_t max_input = 0;
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < n; ++i) {
    const TraceRequest& r = trace[i];
    ASSERT_GE(r.input_length, 1);
    ASSERT_LE(r.input_length, 131072);
    ASSERT_GE(r.output_length, 1);
    ASSERT_EQ(r.num_hash_ids, (r.input_length + 511) / 512);
    if (i > 0) {
      ASSERT_GE(r.timestamp_ms, trace[i - 1].timestamp_ms);
    }
    sum += static_cast<double>(r.input_length);
    max_input = std::max(max_input, r.input_length);
    lengths.push_back(r.input_length);
  }
  const double mean = sum / static_cast<double>(n);
  EXPECT_GT(mean, 9000);
  EXPECT_LT(mean, 15000);
  std::sort(lengths.begin(), lengths.end());
  const int64_t median = lengths[n / 2];
  EXPECT_GT(median, 4000);  // long tail: median well below the mean
  EXPECT_LT(median, 9000);
  EXPECT_GT(max_input, 60000);
  const double rate_per_s =
      static_cast<double>(n - 1) / (static_cast<double>(trace.back().timestamp_ms) / 1000.0);
  EXPECT_NEAR(rate_per_s, 3.4, 0.15);
}

}  // namespace
}  // namespace kvferry::tools
