"""Sparse parameters: embedding tables that live only on the servers (issue 19)."""
