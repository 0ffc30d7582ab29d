"""The bound that keeps the detokenizer's state table from ever filling: admission, not eviction.

The detokenizer holds one state per live request and never evicts one (a lost state is a lost
output: seed 001's DETOKENIZER_MAX_STATES failure), so the API server must never let more requests
be live than its table holds. Live sequences are the queued ones (bounded by --max-queued-requests),
the running ones (bounded by --max-num-seqs) and preempted ones that already produced output, which
neither bound covers; hence an explicit check on all of them:

    live sequences <= max_live = queued bound + max_num_seqs
    max_live + HEALTH_PROBES <= detokenizer MAX_STATES          (checked at start-up)

A request beyond max_live gets the same 503 `server_overloaded` as a full queue. The detokenizer
refuses (503) rather than evicts if aborted requests' ends are still on their way to it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.frontend.detokenizer_process import MAX_STATES
from tokenmill.frontend.request_error import RequestError

logger = logging.getLogger(__name__)

# Internal probes are never refused: the start-up request and one /health probe shared by all callers.
HEALTH_PROBES = 2


def install_live_bound(manager: Any, max_num_seqs: int, detokenizer_max_states: int = MAX_STATES) -> bool:
    """At start-up, once the scheduler reported its limits: set manager.live_bound, or mark the
    server unhealthy (False) if the configured bounds could overfill the detokenizer's table."""
    queued = manager.queued_bound(manager.limits)
    max_live = queued + max_num_seqs
    if max_live + HEALTH_PROBES > detokenizer_max_states:
        manager.mark_unhealthy(
            f"--max-queued-requests ({queued}) + --max-num-seqs ({max_num_seqs}) + {HEALTH_PROBES} health probes "
            f"exceed the detokenizer's {detokenizer_max_states} request states; lower them")
        return False
    manager.live_bound = max_live
    logger.info("admission: at most %d live sequences (%d queued + %d running; detokenizer holds %d)",
                max_live, queued, max_num_seqs, detokenizer_max_states)
    return True


def check_live(manager: Any, seqs: Sequence[Any], internal: bool) -> None:
    """Refuse `seqs` (503) if admitting them would make more sequences live than manager.live_bound."""
    bound = manager.live_bound
    if bound is None or internal:
        return
    live = sum(1 for state in manager._states.values() if not state.finished)  # the manager's own table
    if live + len(seqs) > bound:
        manager.metrics.observe_rejected("too_many_live")
        raise RequestError(f"the server is overloaded: {live} requests are in flight (at most {bound}); retry later",
                           503, code="server_overloaded", headers={"Retry-After": str(manager.RETRY_AFTER_S)})
