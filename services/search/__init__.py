"""Search: the hybrid search (``search``), the ranking stage after fusion (``ranking``), and the vectors
computed at capture that the embedding job and the write-time decisions reuse (``recent_vectors``)."""
