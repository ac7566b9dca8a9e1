"""Relay algorithms package."""
