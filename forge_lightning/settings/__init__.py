"""The module's settings: each declared once (declare.py) as a field of its typed group (groups/, a
file per layer that reads them), and what is read from those fields: the module's signature and
help (signature.py), the range checks (checks.py, with the checks across settings), the parts the
module is built from (assembly.py), its preflight as the settings size it (module_preflight.py), and
TRL's names for them (trl_names.py)."""
