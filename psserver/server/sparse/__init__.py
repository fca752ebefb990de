"""Sparse parameters: embedding tables that live only on the servers."""
