"""The prefill worker: runs prompts, samples their first token, ships their KV to decode workers."""
