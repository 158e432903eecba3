"""A trained agent put to use: `ask` (one question, live), `serve` (an MCP server), `export` (a checkpoint for
vLLM, transformers or llama.cpp)."""
