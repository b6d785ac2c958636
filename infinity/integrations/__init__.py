"""Integrations with other libraries (imported on demand: ``infinity.integrations.hf``)."""
