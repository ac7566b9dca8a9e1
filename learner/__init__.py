"""Relay learner package."""
