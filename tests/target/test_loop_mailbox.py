"""The engine thread's outputs reach the event loop in order, with one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading
import time

from services.target.engine.loop_mailbox import LoopMailbox, held, mailbox_for


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


def test_posts_inside_held_wait_for_its_end_and_then_wake_each_loop_once():
    async def main():
        box = LoopMailbox(asyncio.get_running_loop())
        q = asyncio.Queue()
        seen_inside = []

        def engine_step():
            with held():
                for i in range(18):
                    box.post(q, i)
                    if i == 0:
                        time.sleep(0.05)  # the loop is free meanwhile: nothing may be delivered yet
                        seen_inside.append(q.qsize())

        await asyncio.to_thread(engine_step)
        got = [await asyncio.wait_for(q.get(), 5) for _ in range(18)]
        return box.wakeups, got, seen_inside

    wakeups, got, seen_inside = asyncio.run(main())
    assert (wakeups, got, seen_inside) == (1, list(range(18)), [0])
