"""The module's settings: their typed groups (groups.py), their range checks (checks.py), the parts
the module is built from (components.py), and TRL's names for them (trl_names.py)."""
