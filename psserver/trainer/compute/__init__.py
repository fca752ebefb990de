"""A trainer's own tensor work in the trainer-compute protocols (``pull``, ``pushpull``): the
gradient buckets filled during backward, flat buffers, and a batch's embedding rows."""
