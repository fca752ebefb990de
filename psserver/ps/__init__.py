"""The parameter server: rank 0 hosts the model in stages, trainers join over RPC."""
