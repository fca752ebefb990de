"""Embedding tables across hosts: ``tables`` runs it, ``hosts`` builds the hosts, ``measure``
reads the counters, ``report`` writes the tables."""
