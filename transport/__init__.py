"""Relay transport package."""
