"""The decode worker: the BATON scheduler and batch, embedding staged KV into running decodes."""
