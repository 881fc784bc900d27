"""Wiring, lifecycle, configuration, CLI and HTTP for the consumer service."""
