"""The durable job queue's worker (``worker``): drains every organization's ``jobs`` table and runs the handler
the composition root registered for each job kind."""
