"""Earlier implementations kept for benchmarks to time against (never imported by the services)."""
