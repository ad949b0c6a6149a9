// Sends one chunk of a room layer by layer through a prefill connector: a layerwise pass over
// `pages` (prefill's pages of the chunk, starting at the room's page `first_page`), each layer
// marked ready in order (or last layer first with `reverse`), the aux row with the last chunk.
// Fails the calling test (gtest assertions) on an error.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "kvferry/connector.h"

namespace kvferry::testutil {

inline void SendLayerwise(PrefillConnector& c, uint64_t room, int64_t first_page,
                          std::vector<int32_t> pages, std::optional<int32_t> aux_row, int layers,
                          bool reverse = false) {
  PrefillConnector::LayerwiseChunk chunk;
  chunk.room = room;
  chunk.first_page = first_page;
  chunk.src_pages = std::move(pages);
  chunk.aux_row = aux_row;
  auto pass = c.BeginLayerwisePass(std::span(&chunk, 1));
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int k = 0; k < layers; ++k) {
    Status s = c.MarkLayerReady(*pass, reverse ? layers - 1 - k : k);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
}

}  // namespace kvferry::testutil
