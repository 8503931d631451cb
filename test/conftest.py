import pytest

from multirank import close_pools, get_pool


@pytest.fixture(scope="session", autouse=True)
def _shutdown_pools():
    yield
    close_pools()


@pytest.fixture
def ranks():
    """``ranks(world_size, backend=None, env=None)`` -> the shared :class:`multirank.RankPool` (gloo unless
    ``$TORCH_TP_TEST_BACKEND`` names another backend)."""
    return get_pool
