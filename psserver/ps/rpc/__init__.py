"""What crosses the wire between trainers and server processes: the messages, the rendezvous store
and RPC names, every private torch RPC API in use, and the allow-list of what an RPC message
may name."""
