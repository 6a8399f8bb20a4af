"""The engine thread's outputs reach the event loop in order, with one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

from services.target.server.loop_mailbox import LoopMailbox, mailbox_for


def test_a_burst_posted_while_the_loop_is_busy_wakes_it_once_and_keeps_each_queues_order():
    async def main():
        box = LoopMailbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(3)]

        def engine_step():  # 18 sequences' outputs of one step, per queue in order
            for i in range(18):
                box.post(queues[i % 3], i)

        worker = threading.Thread(target=engine_step)
        worker.start()
        worker.join()  # the loop is held here, as by a busy callback, while the whole burst is posted
        got = [[await q.get() for _ in range(6)] for q in queues]
        return box.wakeups, got

    wakeups, got = asyncio.run(main())
    assert wakeups == 1
    assert got == [list(range(k, 18, 3)) for k in range(3)]


def test_an_item_posted_while_a_delivery_runs_is_not_left_behind():
    async def main():
        box = LoopMailbox(asyncio.get_running_loop())
        q = asyncio.Queue()
        posted = threading.Event()
        box.post(q, "first")
        first = await q.get()  # the first delivery ran and cleared its flag
        threading.Thread(target=lambda: (box.post(q, "second"), posted.set())).start()
        second = await asyncio.wait_for(q.get(), 5)
        return first, second, box.wakeups

    assert asyncio.run(main()) == ("first", "second", 2)


def test_each_loop_has_one_mailbox():
    async def main():
        loop = asyncio.get_running_loop()
        return mailbox_for(loop) is mailbox_for(loop)

    assert asyncio.run(main())
