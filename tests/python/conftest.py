"""pytest set-up shared by the Python tests.

The ``gguf`` the tests and the converter they call in-process use is the environment's: the patched llama.cpp tree's
gguf-py, which ci/setup.sh installs (no import swaps it).
"""

from pathlib import Path

import pytest

# The slowest test files first, slowest leading (the sum of their cases' times in the full run of 2026-12-06,
# build/test-results/pytest.xml: 339, 215, 189, 189, 173, 139, 135, 122, 110, 102, 75, 57, 54 s; every other file
# under 50 s). ci/test.sh runs pytest-xdist with --dist loadfile, which hands whole files to the workers in
# collection order: a long file collected last would run alone while the other worker idles. Every other file keeps
# its place.
SLOW_FILES_FIRST = ("test_qat_mllama.py", "test_ci_tooling.py", "test_codec_importance.py", "test_qat_train.py",
                    "test_gptq_c.py", "test_gptq_s3d8.py", "test_kv_smollm2.py", "test_convert.py", "test_faults.py",
                    "test_convert_smollm2.py", "test_phone_path.py", "test_native.py", "test_convert_upstream.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).name, len(rank)))  # stable: test order within a file kept


@pytest.fixture(scope="session")
def smollm2_f16_and_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct as an f16 GGUF and 60,000 characters of the training text: the input of the tests
    that run llama-imatrix on a real model (test_codec_importance.py, test_gptq_c.py), converted once per worker."""
    from fixtures import assets
    from convert.to_gguf import main as convert_main

    d = tmp_path_factory.mktemp("smollm2")
    f16 = d / "f16.gguf"
    assert convert_main([str(assets.smollm2_hf_dir()), "--type", "f16", "-o", str(f16), "--no-progress"]) == 0
    text = d / "train.txt"
    text.write_text(assets.wiki_text("train")[:60000], encoding="utf-8")
    return f16, text


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    """The tiny S3D8 Llama whose greedy answer is fixed by construction (tests/mllama/builds.py), once per module:
    the builds compared with the x86 one (test_phone_path.py, test_vulkan.py) run it."""
    from tests.mllama.builds import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_mllama(tmp_path_factory: pytest.TempPathFactory):
    """The tiny S3D8 Llama 3.2 Vision (the cached conversion of tests/mllama) and a one-tile image, once per module."""
    from tests.mllama.builds import make_tiny_mllama

    return make_tiny_mllama(tmp_path_factory.mktemp("image"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives headless Chromium against llama-server's web page "
                                       "(tests/browser; `-m browser` runs only these)")
