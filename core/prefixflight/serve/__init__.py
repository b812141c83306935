"""Serving prefixflight engines: HTTP front ends and distributed deployments."""
