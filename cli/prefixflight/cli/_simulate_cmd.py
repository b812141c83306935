"""``prefixflight simulate KIND``: simulations, one sub-command per entry of `SIMULATIONS`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from . import _simulate_flight_cmd
from ._router_cmd import register_router

__all__ = ["SIMULATIONS", "register"]

RegisterSimulation = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

SIMULATIONS: tuple[RegisterSimulation, ...] = (register_router, _simulate_flight_cmd.register)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a cluster or an engine, side by side",
        description="Simulations on the pure core: no model, no clock, deterministic.",
    )
    kinds = p.add_subparsers(dest="simulation", metavar="KIND", required=True)
    for register_simulation in SIMULATIONS:
        register_simulation(kinds)
