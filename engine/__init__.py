"""Shared model execution: loading, the BATON batch KV layout, attention, sampling. No networking."""
