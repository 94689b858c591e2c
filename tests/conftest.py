import pytest

from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def llada_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llada"), arch="llada", seed=1)


@pytest.fixture(scope="session")
def dream_path(tmp_path_factory):
    # GQA: 4 query heads share each K/V head.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dream"), arch="dream", seed=2,
                                num_heads=8, num_kv_heads=2)


@pytest.fixture(scope="session", params=["llada", "dream"])
def tiny_path(request, llada_path, dream_path):
    return llada_path if request.param == "llada" else dream_path


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory) -> str:
    """A tiny LLaDA checkpoint with the demo's char-level tokenizer and chat template."""
    path = tmp_path_factory.mktemp("llada_tok")
    make_tiny_checkpoint(path, arch="llada", seed=3, vocab_size=VOCAB_SIZE)
    write_tokenizer(path)
    return str(path)
