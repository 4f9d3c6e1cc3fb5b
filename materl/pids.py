"""Whether a process still runs, for files that name their writer's pid (a sweep's lock, a
checkpoint save's temp folder): a dead writer's file may be taken over or removed."""

from __future__ import annotations

import os


def alive(pid: int, *, count_self: bool) -> bool:
    """Whether process ``pid`` exists (one we may not signal exists too). ``count_self``: whether
    this process's own pid counts as alive; a caller asking "is another process using this?" passes
    False, since a file naming us is left from an earlier attempt of our own."""
    if pid == os.getpid():
        return count_self
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
