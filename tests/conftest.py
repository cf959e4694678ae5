import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:  # one worker per core: one thread each, for the
    os.environ.setdefault("OMP_NUM_THREADS", "1")                 # tests and the processes they start
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _leaves_the_checkout_alone():
    """No test writes into the repository's root (a run rooted in the working directory would leave its privacy
    ledger or lightning_logs there, to be committed by mistake): the test that does fails, named."""
    before = set(os.listdir(ROOT))
    yield
    new = set(os.listdir(ROOT)) - before - {".pytest_cache", ".cache"}  # .cache: the studies' feature cache (ignored)
    assert not new, f"this test wrote {sorted(new)} into {ROOT}; root its runs in tmp_path"
