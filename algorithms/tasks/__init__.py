"""Bundled tasks: problem generators, prompt text and target formats (no models, no files)."""
