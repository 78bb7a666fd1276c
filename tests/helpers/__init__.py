"""What the tests share besides fixtures: tiny models and tokenizers, fake engines, rewards, tools
and runners, the user code that subprocesses and sandbox workers import by name (faults, hostile,
sticky) and the scripts torchrun starts (ddp_*). Test modules import from here (``from
helpers.models import make_model``: pyproject.toml puts tests/ on the path), fixtures live in
conftest.py, and no test module imports another (tests/test_layout.py)."""
