"""Helpers shared by tests: system programs fetched as files (fetch_tools, tools), a local
Prometheus server, PromQL and metric-catalog readers, TLS material, a manager-state fingerprint."""
