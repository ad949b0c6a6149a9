// Keeps kvferry_testutil non-empty before any helper exists.
