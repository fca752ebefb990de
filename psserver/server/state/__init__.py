"""The server's state in shared memory, so that a restarted process loses nothing: the private
directory, the arena of tensors, its metadata and layout, the segments, and ``memory``, which
puts them together."""
