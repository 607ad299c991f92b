"""``transport.tasks.stop_task``: stopping a helper task never absorbs a cancellation of the
caller (the lost Ctrl-C of ``secagg simulate``: a ``suppress(CancelledError)`` around the
helper's await swallowed the caller's own cancel when it arrived there)."""

from __future__ import annotations

import asyncio

from transport.tasks import stop_task


async def _slow_to_stop(release: asyncio.Event) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await release.wait()  # a teardown that takes its time, then ends normally


def test_a_cancel_of_the_caller_arriving_while_it_waits_for_the_child_propagates() -> None:
    async def main() -> None:
        release = asyncio.Event()
        child = asyncio.create_task(_slow_to_stop(release))
        await asyncio.sleep(0)
        caller = asyncio.create_task(stop_task(child))
        await asyncio.sleep(0)
        assert not caller.done()  # waiting for the child's teardown
        caller.cancel()
        await asyncio.wait({caller}, timeout=5.0)  # with the cancel absorbed: waits for ever
        assert caller.cancelled()
        assert not child.done()  # the child was cancelled once, by stop_task, and finishes
        release.set()
        await asyncio.wait({child})
        assert not child.cancelled() and child.exception() is None

    asyncio.run(main())


def test_the_child_s_own_outcome_is_not_raised_and_an_uncancelled_caller_continues() -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise RuntimeError("teardown failed")

    async def main() -> list[str]:
        steps = []
        for child in (asyncio.create_task(failing()),
                      asyncio.create_task(asyncio.sleep(3600))):
            await asyncio.sleep(0)
            await stop_task(child)
            assert child.done()
            steps.append("stopped")
        done = asyncio.create_task(asyncio.sleep(0))
        await done
        await stop_task(done)  # already finished: nothing to cancel
        return steps

    assert asyncio.run(main()) == ["stopped", "stopped"]
