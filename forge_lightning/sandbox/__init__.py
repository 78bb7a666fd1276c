"""Where user code (rewards, tools, environments) runs apart from the trainer: the pool of worker
processes the trainer holds (pool.py), one worker as it holds it (process.py), its sticky episodes
(episode.py, the worker's side in episode_worker.py), what crosses back as data (frames.py), what
a worker may see (view.py), the worker itself (worker.py), and what the machine gives it
(isolation.py: namespaces and limits, landlock.py, seccomp.py).

Its modules import nothing of the package outside this folder, so that a worker, a fresh
interpreter, starts in a moment; this file imports none of them for the same reason."""
