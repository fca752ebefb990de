"""The reader role: processes that read versions of the weights while training runs (RL
rollout workers, online serving) and never train: no place in the RPC group, sync rounds or
membership, and a credential that reads and does nothing else.

``reader.Reader`` is the library (``psserver.read(...)``); ``psserver pull`` its command.
"""
