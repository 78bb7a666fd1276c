"""Worked examples of extending forge_lightning; each module is meant to be read and copied."""
