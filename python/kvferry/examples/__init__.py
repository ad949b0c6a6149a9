"""Worked examples over kvferry: a small transformer served disaggregated (pd_generate)."""
