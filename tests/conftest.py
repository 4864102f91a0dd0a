"""Shared fixtures: the built-in corpus cached under the session's temp folder, the Hub kept offline.

Multi-process (spawned gloo ranks) and torchrun tests carry the `slow` marker:
`python -m pytest -q -m "not slow" tests` is the fast inner loop; the README command runs everything.
"""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory):
    """Keep the built-in corpus (and token stores) of the tests out of the user's ~/.cache; subprocesses too."""
    cache = os.environ.get("TITANLITE_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TITANLITE_CACHE", cache)
        mp.setenv("HF_DATASETS_CACHE", os.path.join(cache, "hf_datasets"))  # datasets' Arrow copies of local files
        yield cache


@pytest.fixture(scope="session", autouse=True)
def offline_hub():
    """Keep `datasets` and the Hub client off the network (they even ping the Hub when opening local files)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        try:
            import datasets
            import huggingface_hub.constants
        except ImportError:
            yield
            return
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", os.environ["HF_DATASETS_CACHE"])
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield
