"""Relay generators package."""
