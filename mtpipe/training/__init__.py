"""Training: the update, the loop, validation, loss, batches, resume, metrics, distributed launch."""
