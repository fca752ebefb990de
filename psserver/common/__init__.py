"""What trainer and server processes both speak: the messages and the server's RPC surface they
name (``calls``), the rendezvous store and RPC names, every private torch RPC API in use and the
allow-list of what a message may name, the transports, the partition of parameters and
embedding rows over server processes, and the flat-tensor helpers both sides apply alike.

Nothing here imports ``psserver.server`` or ``psserver.trainer`` (import-linter keeps it so)."""
