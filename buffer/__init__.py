"""Relay buffer package."""
