import pytest

from services.dense.loader import load_model
from services.dense.runtime import DenseRuntime
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import FAMILY_CHECKPOINTS, checkpoint

PROMPT = (
    "The quick brown fox jumps over the lazy dog, and a Mixture-of-Experts model routes each token "
    "to a few experts."
)


@pytest.fixture(params=FAMILY_CHECKPOINTS)
def family_checkpoint(request):
    """(name, path) of every family's tiny checkpoint."""
    return request.param, checkpoint(request.param)


@pytest.fixture
def prompt_ids(family_checkpoint):
    ids = Tokenizer(family_checkpoint[1]).encode(PROMPT)
    assert len(ids) >= 24
    return ids


def load_fp32(path, experts=None):
    return load_model(path, DenseRuntime(dtype="float32", device="cpu"), experts)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """After the whole run, no tandem segment may remain in /dev/shm."""
    from services.common.shm_layout import leftover_segments

    before = set(leftover_segments())
    yield
    left = set(leftover_segments()) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
