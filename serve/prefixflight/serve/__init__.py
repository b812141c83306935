"""prefixflight's server shell: the engine behind the wire formats engines are reached by.

- `prefixflight.serve.http`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an
  `AsyncEngine`, with Prometheus metrics under vLLM's names; ``prefixflight serve`` runs it.
- `prefixflight.serve.kv_events`: the prefix cache's KV events on vLLM's ZMQ/msgpack wire
  (publisher, subscriber, per-replica block indexes a router reads).

Each module needs the ``serve`` extra (and the torch backend to run a model); importing this
package alone imports none of them. It imports the core and the backends, never the reverse.
"""

__all__: list[str] = []
