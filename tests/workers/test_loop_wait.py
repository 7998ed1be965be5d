"""The engine loop's wait policy (workers/engine/loop_wait.py): no busy polling while
only transfers are pending, no added wait while computing or after input."""

from tandem.workers.engine.loop_wait import IDLE_WAIT_MS, MAX_PENDING_WAIT_MS, LoopWait


def test_computing_never_waits():
    wait = LoopWait()
    assert [wait.next_ms(True, True) for _ in range(3)] == [0, 0, 0]


def test_pending_transfers_back_off_to_the_cap():
    wait = LoopWait()
    assert [wait.next_ms(True, False) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert MAX_PENDING_WAIT_MS == 8


def test_input_or_output_steps_at_once_then_backs_off_again():
    wait = LoopWait()
    for _ in range(5):
        wait.next_ms(True, False)
    wait.reset()
    assert [wait.next_ms(True, False) for _ in range(3)] == [0, 1, 2]


def test_idle_waits_long_and_forgets_the_backoff():
    wait = LoopWait()
    for _ in range(5):
        wait.next_ms(True, False)
    assert wait.next_ms(False, False) == IDLE_WAIT_MS
    assert wait.next_ms(True, False) == 1
