"""Integrations with other libraries (imported on demand: ``infinity.integrations.hf``).

Owns: the glue to each library (the Hugging Face Trainer). May import:
checkpoint/, api.py and everything below.
"""
