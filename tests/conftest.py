"""Shared fixtures: the built-in corpus cached under the session's temp folder, the Hub kept offline.

Multi-process (spawned gloo ranks) and torchrun tests carry the `slow` marker:
`python -m pytest -q -m "not slow" tests` is the fast inner loop; the README command runs everything.
"""

import os

import pytest

from helpers import TEST_DEVICE


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


@pytest.fixture(autouse=True)
def no_leaked_environment():
    """A test that runs a titanlite command in this process (whose one-process group sets RANK, MASTER_PORT, ...)
    leaves the environment as it found it: later subprocesses must not inherit a port that may still be bound."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def single_process_device():
    """In-process Trainers compute on the test device (cpu unless TITANLITE_TEST_DEVICE=cuda), even where a GPU is
    visible: a suite run is on one device by choice, never by accident of the machine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TITANLITE_DEVICE", TEST_DEVICE)
        yield TEST_DEVICE


class S3:
    """The test S3 endpoint: `env` reaches it (AWS variables), `down` takes it down while the file exists."""

    def __init__(self, env: dict, down):
        self.env, self.down = env, down

    def use(self, monkeypatch) -> None:
        """Point this process (and the processes it starts) at the endpoint, up."""
        for key, value in self.env.items():
            monkeypatch.setenv(key, value)
        self.up()
        try:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()  # no client of another endpoint or key is reused
        except ImportError:
            pass

    def up(self) -> None:
        """Bring the endpoint back and wait until it accepts connections (the relay's thread may be slow to listen
        again while this process is busy)."""
        from helpers import wait_for_endpoint

        self.down.unlink(missing_ok=True)
        wait_for_endpoint(self.env["AWS_ENDPOINT_URL"])


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on this machine, behind a relay that a test can take down (helpers.s3_server)."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from helpers import s3_server

    down = tmp_path_factory.mktemp("s3") / "down"
    with s3_server(down) as env:
        yield S3(env, down)
