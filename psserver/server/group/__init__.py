"""Several server processes: server 0's group of the others, a server of rank > 0, and the one
RPC function they call each other through (the partition plan both sides use:
``psserver.common.partition``)."""
