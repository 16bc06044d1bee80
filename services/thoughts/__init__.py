"""Thoughts: capture, read, delete (``thoughts``), the write-time decisions of a capture (``decisions``) and the
history of merged and replaced originals with the links between thoughts (``history``)."""
