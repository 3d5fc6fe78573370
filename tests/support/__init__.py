"""Helpers shared by tests: Debian packages installed on demand, a local Prometheus server."""
