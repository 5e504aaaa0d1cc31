import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _host_load_reads_quiet():
    """Linear choices in tests do not depend on the real host's load: runtime.host_load reads no
    /proc/stat (every timing window counts as quiet, no choice is provisional). The re-time policy
    has its own tests (tests/unit/test_backend_choice.py) with scripted loads and synthetic readings."""
    from appliance.runtime import host_load

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_load, "read_proc_stat", lambda: None)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch, tie=False, num_kv_heads=2) -> Path, cached per session."""
    cache = {}

    def get(arch="llama", tie=False, num_kv_heads=2, **kw):
        key = (arch, tie, num_kv_heads, repr(sorted(kw.items())))
        if key not in cache:
            name = f"{arch}-tie{int(tie)}-kv{num_kv_heads}-" + str(len(cache))
            cache[key] = make_tiny_model(tmp_path_factory.mktemp("models") / name, arch, tie, num_kv_heads, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")
