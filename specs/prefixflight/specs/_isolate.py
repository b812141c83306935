"""`isolated`: run an implementation in a child process, so a crash is a finding.

An engine with a C core can abort or segfault the process (libCacheSim aborts for some
cache sizes). Wrapped with `isolated`, its objects live in a worker process; every call is
sent over a pipe, and if the worker dies the call raises `EngineCrashed` (an
`AssertionError`) naming the call, the signal and what the engine printed. Hypothesis then
shrinks the crash like any other failure; the next object gets a fresh worker::

    run_state_machine_as_test(S3FIFOConformance.for_factory(isolated(MyCS3FIFO)))

The factory (and everything its calls take and return) must pickle: a class or function
importable by module and name, or a `functools.partial` of one. The worker sees the same
``sys.path`` as the parent. Its standard output goes to its standard error, so what a C
library prints cannot corrupt the pipe; the last lines of it come back with a crash.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import IO, Any

from prefixflight.core import UsageError

from ._adapter import configs_of, name_of, semantics_of
from ._declare import EngineCrashed

__all__ = ["isolated", "serve"]

_BOOT = (
    "import os, pickle, sys\n"
    "sys.path[:0] = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
    "out = os.fdopen(os.dup(1), 'wb')\n"
    "os.dup2(2, 1)\n"
    "from prefixflight.specs._isolate import serve\n"
    "serve(sys.stdin.buffer, out)\n"
)


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The worker's loop: build objects, call their methods, send back results or errors."""
    objects: dict[int, Any] = {}
    while True:
        reply: tuple[bool, Any]
        try:
            op, oid, target, args, kwargs = pickle.load(inp)
        except EOFError:
            return
        except Exception as exc:  # e.g. a class the worker cannot import: say so, go on
            op = "none"
            reply = (False, UsageError(f"the worker cannot load the call: {exc}"))
        try:
            if op == "none":
                pass
            elif op == "new":
                obj = target(*args, **kwargs)
                objects[oid] = obj
                names = [n for n in dir(obj) if not n.startswith("_")]
                reply = (True, {n: callable(getattr(obj, n)) for n in names})
            elif op == "del":
                objects.pop(oid, None)
                reply = (True, None)
            elif op == "get":
                reply = (True, getattr(objects[oid], target))
            else:
                reply = (True, getattr(objects[oid], target)(*args, **kwargs))
        except BaseException as exc:
            reply = (False, exc)
        try:
            data = pickle.dumps(reply)
        except Exception:  # an error or result that does not pickle: report it as text
            data = pickle.dumps((False, AssertionError(f"{type(reply[1]).__name__}: {reply[1]}")))
        out.write(data)
        out.flush()


class _Worker:
    """One child process; ``call`` raises `EngineCrashed` if it dies."""

    def __init__(self) -> None:
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close/crash)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, pickle.dumps(list(sys.path)).hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        self.alive = True

    def call(self, message: tuple[Any, ...], describe: str) -> Any:
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            pickle.dump(message, proc.stdin)
            proc.stdin.flush()
            ok, value = pickle.load(proc.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            self.alive = False
            code = proc.wait()
            self._close_pipes()
            self.stderr.seek(0)
            text = self.stderr.read()[-2000:].decode(errors="replace")
            self.stderr.close()
            raise EngineCrashed(describe, code, text) from None
        if not ok:
            raise value
        return value

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):  # died with unread input
                    pipe.close()

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self._close_pipes()  # the worker sees EOF and returns
            self.proc.wait()
            self.stderr.close()


_worker: _Worker | None = None
_ids = itertools.count()


def _current() -> _Worker:
    global _worker
    if _worker is None or not _worker.alive:
        _worker = _Worker()
    return _worker


class _Proxy:
    """An object living in the worker; its public methods and attributes, forwarded."""

    def __init__(self, factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._worker = _current()
        self._id = next(_ids)
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        self._name = f"{name_of(factory)}({shown})"
        self._names: dict[str, bool] = self._worker.call(
            ("new", self._id, factory, args, kwargs), self._name
        )

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        return self._worker.call(("call", self._id, name, args, kwargs), f"{name}({shown})")

    def __getattr__(self, name: str) -> Any:
        names = self.__dict__.get("_names", {})
        if name not in names:
            raise AttributeError(name)
        if names[name]:
            return functools.partial(self._call, name)
        return self._worker.call(("get", self._id, name, (), {}), name)

    def __len__(self) -> int:
        return int(self._call("__len__"))

    def __contains__(self, item: object) -> bool:
        return bool(self._call("__contains__", item))

    def __repr__(self) -> str:
        return f"isolated {self._name}"

    def close(self) -> None:
        """Drop the object in the worker (the worker stays for the next one)."""
        if self._worker.alive:
            if self._names.get("close"):
                self._call("close")
            self._worker.call(("del", self._id, None, (), {}), "close()")


def isolated(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory``, but each object it makes lives in a worker process (see the module)."""

    inner: Any = factory
    while hasattr(inner, "func"):  # functools.partial
        inner = inner.func
    if getattr(inner, "__module__", None) == "__main__":
        raise UsageError(
            f"isolated({name_of(factory)}): the worker imports the factory by module and "
            "name; define it in an importable module, not in __main__"
        )

    def make(*args: Any, **kwargs: Any) -> Any:
        return _Proxy(factory, args, kwargs)

    make.__name__ = make.__qualname__ = f"isolated_{name_of(factory)}"
    make.__doc__ = f"{name_of(factory)}, in a worker process."
    semantics = semantics_of(factory)
    if semantics is not None:
        make.semantics = semantics  # type: ignore[attr-defined]
    configs = configs_of(factory)
    if configs is not None:
        make.configs = configs  # type: ignore[attr-defined]
    return make


@atexit.register
def _close_worker() -> None:  # pragma: no cover - interpreter shutdown
    if _worker is not None:
        _worker.close()
