"""Saving and loading artifacts: atomic writes, HF layout, the meta.json sidecar."""
