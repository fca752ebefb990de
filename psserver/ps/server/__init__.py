"""One server process: its composition root, the RPC surface trainers call, membership and
admission, status, checkpoints, the supervisor, and export of a checkpoint as a state_dict."""
