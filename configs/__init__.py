"""Relay configs package."""
