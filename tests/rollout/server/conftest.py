"""The fake servers of the server backend's tests: ``fakes(**kw)`` starts one (`fake_server.FakeServer`), each
stopped when the test ends."""
import pytest

from tests.rollout.server.fake_server import FakeServer


@pytest.fixture
def fakes():
    made = []

    def make(**kw):
        made.append(FakeServer(**kw).start())
        return made[-1]

    yield make
    for f in made:
        f.stop()
