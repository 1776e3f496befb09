"""`kimi-pd router --workers N`: N router processes on one port that place as one router.

`table` is the shared-memory segment they share (per-worker load, an event log, per-process blobs),
`share` hooks it into each process's registry, admission and metrics, `supervisor` is the parent that
binds the port once, starts the children, restarts the ones that die and stops them all on SIGTERM.
"""
