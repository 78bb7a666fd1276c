"""A run's folder and its checkpoints: the folder a run owns (folder.py), checkpoints written whole
(checkpoint_io.py), what a resume checks (resume.py), signals during user code (signals.py), crash-safe file
writes (fileio.py), objects stored as plain data (specs.py), and how user code is called
(user_code.py)."""
