"""The forward context is per thread (found by the chaos soak of issue 57): two engines stepping at once in one
process, on threads of their own, each attend with their own step's layers.  A process-wide context let one
engine's attention read the other's (``write_kv`` saw the other model's head size, or no context at all)."""

from __future__ import annotations

import threading

from patchbay.toolkit.forward_context import ForwardContext, current_forward_context, forward_context


def test_two_threads_in_their_own_forward_pass_each_see_their_own_context():
    entered = threading.Barrier(2)
    seen: dict[str, ForwardContext] = {}
    mine = {name: ForwardContext({}, [name]) for name in ("first", "second")}

    def step(name: str) -> None:
        with forward_context(mine[name]):
            entered.wait(10)  # both passes are in progress now
            seen[name] = current_forward_context()
            entered.wait(10)

    threads = [threading.Thread(target=step, args=(name,)) for name in mine]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert seen == mine
