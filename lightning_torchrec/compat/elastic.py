"""torchelastic's restart count, which the agents of a multi-node job do not share.

torchrun's agents count a restart only where a worker failed: the other agents restart their
workers as a change of membership, without counting it. Measured with torch 2.13 (two agents of
2 workers, one worker killed): the restarted workers of one agent had
``TORCHELASTIC_RESTART_COUNT=1``, the other agent's ``0``. Workers that build their process
groups in the agent's shared TCPStore key them by that count (torch's own ``env://`` init under
``/worker/attempt_{count}``, this package under
:data:`~lightning_torchrec.distributed.ATTEMPT_PREFIX`), so the two halves wait for each other's
keys under different names, or read a dead attempt's. With
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every agent, each rendezvous round gets a store of
its own and no count is needed: the same job restarted and finished.
"""

from __future__ import annotations

import os
import warnings

#: The warning a multi-agent job that may restart gets on rank 0.
MULTI_AGENT_RESTARTS = (
    "torchrun runs {agents} agents with --max-restarts {restarts} and workers sharing the "
    "agent's TCPStore: after a failure the agents restart their workers with different "
    "TORCHELASTIC_RESTART_COUNTs, and process groups keyed by it do not meet (see "
    "docs/cluster.md). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment."
)


def warn_multi_agent_restarts() -> None:
    """Warns on rank 0 of a torchrun job whose restarts would not meet (see the module)."""
    agents = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and agents > 1 and restarts > 0 and os.environ.get("RANK", "0") == "0":
        message = MULTI_AGENT_RESTARTS.format(agents=agents, restarts=restarts)
        warnings.warn(message, UserWarning, stacklevel=2)
