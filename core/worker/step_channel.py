"""How rank 0 hands its messages (setup, runner spec, one pickled step each) to the other tensor-parallel ranks.

Each side holds a :class:`multiprocessing.connection.Connection`
(length-prefixed messages; end of file when the other side closes), so the
rank's loop does not depend on what carries them.  When rank 0 starts the
ranks itself on its own machine, that is a **pipe** (:func:`open_pipe`):
a rank sees end of file when rank 0 exits or dies.  Nothing is sent idle,
so an idle server never times out.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


def open_pipe() -> tuple[int, Connection]:
    """A pipe for a child rank: the read end's file descriptor (to pass to the child) and rank 0's writing end."""
    read_fd, write_fd = os.pipe()
    return read_fd, Connection(write_fd, readable=False)


def pipe_end(fd: int) -> Connection:
    """The child's reading end of :func:`open_pipe`'s pipe, from its inherited file descriptor."""
    return Connection(fd, writable=False)
