"""The serving shell: an OpenAI-compatible HTTP server and KV events on the vLLM wire."""
