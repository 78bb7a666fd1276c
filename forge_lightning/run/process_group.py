"""The end of a process that ran trainer ranks: its process group destroyed while Python still runs.

Lightning leaves the default process group up when a fit ends (a script may fit again). A rank
that then exits with it up can abort (SIGABRT, "terminate called without an active exception")
after a finished fit: gloo's worker threads may still hold tensors when the interpreter is torn
down (pytorch/pytorch#179291; PyTorch's docs ask each trainer process to call
``destroy_process_group`` at its end). ``forge-lightning`` calls :func:`release_process_group`
once its command is done; a script of your own that fits on several processes should too.
"""

from __future__ import annotations

import torch.distributed as dist


def release_process_group() -> bool:
    """Destroy this process's default process group, and every group made from it, if one is up;
    whether one was."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True
