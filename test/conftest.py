import pytest

from multirank import close_pools, get_pool


@pytest.fixture(scope="session", autouse=True)
def _shutdown_pools():
    yield
    close_pools()


@pytest.fixture
def ranks():
    """``ranks(world_size)`` -> the shared gloo :class:`multirank.RankPool` of that size."""
    return get_pool
