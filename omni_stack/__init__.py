"""The launcher as a library: run omni-serving's services as one stack on this host.

`omni-serving up` (omni_cli), `bench e2e` and the tests drive the same code:
`Stack(StackConfig(...))`, `start()`, `supervise()` or `poll()`, `stop()`.
One module per job, each importing only those above it in this list:

- `errors`: StackError, ConfigError (names the key), StartAborted;
- `config`: `StackConfig`, the `up` options (`UP_OPTIONS`), config files and
  their coercion, replica naming;
- `commands`: the services' command lines and environment
  (`service_commands`, what compose and Kubernetes also run);
- `processes`: Linux process plumbing (spawning without fork(), process
  groups, the child subreaper, psutil helpers);
- `runtime`: the runtime directory, its `owner` lock, the sweeps of what dead
  stacks left (runtime directories, shared-memory arenas);
- `health`: the readiness check of a service;
- `supervision`: restarting services that exit on their own;
- `rolling`: rolling restart of the materializers (handover on the socket);
- `stack`: `Stack`, which starts, supervises and stops the services;
- `up`: `run_up`, the `up` command; `running`: finding a running `up` and
  asking it for a rolling restart (`omni-serving restart materializer`).

Host and address helpers (wildcard hosts, where to dial, free ports, socket
path length) are omni_common.net's; the services' side of the parent-death
signal is omni_common.lifeline's.
"""
