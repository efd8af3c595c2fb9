"""Parsing done by kept libraries: versions (`packaging.version`), requirement strings in pip commands
(`packaging.requirements`: a protected distribution is never installed, however its requirement is spelled)."""

from __future__ import annotations

import pytest

from dispatcher.tools.install_plan import _pip_words
from dispatcher.versions import at_least, release


@pytest.mark.parametrize("version, expected", [
    ("2.13.0+cpu", (2, 13, 0)), ("v1.2", (1, 2)), ("2.8.0.dev20250101+cu128", (2, 8, 0)),
    ("2.5.0a0+872d972e41.nv24.08", (2, 5, 0)), ("0.0.29.post3", (0, 0, 29)), ("unknown", ()), ("", ()), (None, ()),
])
def test_release_parts(version, expected):
    assert release(version) == expected


def test_floors():
    assert at_least("2.13.0+cpu", "2.5") and at_least("2.5", "2.5.0") and not at_least("2.4.1", "2.5")
    assert at_least("2.9.0.dev20250801", "2.9")  # a nightly meets the floor of its release
    assert not at_least("unknown", "1")


@pytest.mark.parametrize("command", [
    "pip install torch", "pip install 'torch>=2.5'", "pip install Torch==2.13.0", "pip install 'torchvision[extra]'",
    "pip install xformers 'torch>=2.5' (a remark)", "pip install --index-url https://download.pytorch.org/whl/cpu torch",
])
def test_pip_commands_naming_a_protected_distribution_are_never_run(command):
    assert _pip_words(command) is None


def test_other_pip_commands_keep_their_words():
    assert _pip_words("pip install 'flash-attn>=2.6.3' --no-build-isolation (builds for minutes)") == [
        "install", "flash-attn>=2.6.3", "--no-build-isolation"]
    assert _pip_words("pip install torch-npu") == ["install", "torch-npu"]  # another distribution
    assert _pip_words("python setup.py install") is None
