"""Typed configuration: the schema every entry point validates against, YAML presets beside it."""
