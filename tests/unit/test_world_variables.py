"""The tests' own guard (tests/conftest.py): world variables written by one test do not reach the next.
The two tests run in this order, in one worker (pytest keeps a file's order; xdist's loadfile too)."""

import os

from stages.training.distributed import WORLD_VARIABLES

_AT_START = {name: os.environ.get(name) for name in WORLD_VARIABLES}


def test_a_test_joins_a_world_of_one_as_init_distributed_does():
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")


def test_the_next_test_sees_the_world_variables_it_started_with():
    assert {name: os.environ.get(name) for name in WORLD_VARIABLES} == _AT_START
