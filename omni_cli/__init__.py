"""The `omni-serving` command line: run services, the whole stack, clients."""
