"""The server's checkpoints: when they are written (``checkpointing``), what they hold
(``content``, ``optimizer_state``) and ``psserver export`` of one as a state_dict (the file
format, shared with collective training: ``psserver.checkpoint``)."""
