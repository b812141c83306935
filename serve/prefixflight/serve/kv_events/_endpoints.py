"""ZMQ endpoints as vLLM reads them: which are bound, which connected, the data-parallel offset.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, 0.32) binds an endpoint that
holds ``*`` or ``::`` or is ``ipc://`` / ``inproc://``, and connects to any other
(``tcp://HOST:PORT``); the replay endpoint is always bound. One extension here: a TCP port
of 0 is bound too (an ephemeral port), since a connection to port 0 reaches nothing, which is
what vLLM does with it.
"""

from __future__ import annotations

import ipaddress
from typing import Final

import zmq

from prefixflight.core import ConfigError

__all__ = ["binds", "is_local", "offset_endpoint", "resolved"]

_LOCAL_TRANSPORTS: Final = ("ipc://", "inproc://")


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcards (``*``, ``::``) and local transports, connect to the rest;
    and bind a TCP port 0."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(_LOCAL_TRANSPORTS)
        or (endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0")
    )


def is_local(endpoint: str) -> bool:
    """Whether only this host can reach ``endpoint``: ``ipc://``, ``inproc://`` or TCP on a
    loopback address (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if endpoint.startswith(_LOCAL_TRANSPORTS):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name
        return False


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` for data-parallel rank ``data_parallel_rank``, as vLLM derives it: a TCP
    port goes up by the rank (port 0 stays: the OS picks), an inproc/ipc name gets
    ``_dp<rank>``; rank 0 keeps it."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(_LOCAL_TRANSPORTS):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    raise ConfigError(
        f"cannot offset endpoint {endpoint!r} by data_parallel_rank {data_parallel_rank}: "
        "give a tcp://host:PORT, ipc:// or inproc:// endpoint"
    )


def resolved(sock: zmq.Socket[bytes], fallback: str) -> str:
    """The endpoint ``sock`` last bound or connected, a wildcard port resolved."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    if isinstance(last, bytes) and last:
        return last.decode("utf-8")
    return fallback
