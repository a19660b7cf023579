"""Prometheus metrics: the registry (`registry.RunnerMetrics`), the guarded HTTP server that
serves it, and the alert rules rendered from one source (`alerting`)."""
