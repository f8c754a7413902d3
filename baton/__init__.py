"""Baton: disaggregated prefill/decode LLM serving. `baton.v1` holds the generated wire code."""
