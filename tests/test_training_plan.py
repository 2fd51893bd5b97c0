"""When the periodic parts of the training loop are due: each says so with `due(step, last)`."""

from conftest import CPU1

from pipeline.checkpoint.saver import Saver
from pipeline.tools.every import Every


def due_steps(part, steps: int = 10, last: int = 10) -> list[int]:
    return [step for step in range(1, steps + 1) if part.due(step, last=step == last)]


def test_a_period_of_0_is_due_only_at_the_last_step():
    assert due_steps(Every(0)) == [10]
    assert due_steps(Every(4)) == [4, 8, 10]
    # The last step is due whether or not it is a multiple
    assert due_steps(Every(5)) == [5, 10]


def test_the_saver_is_due_at_every_n_steps_and_the_last(tmp_path):
    assert due_steps(Saver(tmp_path, CPU1, keep_last=2, asynchronous=False, every=3)) == [
        3,
        6,
        9,
        10,
    ]
    # checkpoint.every_n_steps=0: only the last step (and, in the loop, each new best)
    assert due_steps(Saver(tmp_path, CPU1, keep_last=2, asynchronous=False)) == [10]
    # A run that stops early: its step is the last, whatever the period
    assert Saver(tmp_path, CPU1, keep_last=2, asynchronous=False, every=3).due(7, last=True)
