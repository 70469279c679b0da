"""specserve: exact speculative decoding for LLMs, served on Ray Serve."""
