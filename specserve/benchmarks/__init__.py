"""Benchmark scripts: they print figures measured in one run; nothing here asserts speed."""
