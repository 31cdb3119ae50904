"""A run started from a Hugging Face folder keeps that folder's sampling defaults (tools/stops.py), checked
against their kinds, and `export --hf` writes them back (tests/ranks/test_lora.py walks it end to end)."""
import json

import pytest

from fivefold.config import ConfigError
from fivefold.tools.stops import generation_defaults, keep_stop_ids, stop_ids


class Tok:
    eos_id, vocab_size = 1, 100


def test_the_base_folders_sampling_and_ends_are_kept_in_the_run_folder(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    base.mkdir(), run.mkdir()
    (base / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [7, 9], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "pad_token_id": 3, "max_length": 99, "transformers_version": "x"}))
    keep_stop_ids(base, run)
    kept = json.loads((run / "generation_config.json").read_text())
    assert kept == {"eos_token_id": [7, 9], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                    "repetition_penalty": 1.05, "pad_token_id": 3}     # nothing else of the base's file
    assert stop_ids(Tok(), run) == {1, 7, 9} and generation_defaults(run)["top_k"] == 20


@pytest.mark.parametrize("key, value", [("do_sample", "yes"), ("temperature", 0), ("top_p", 1.5), ("top_k", -1),
                                        ("pad_token_id", 2.5), ("temperature", float("nan"))])
def test_a_sampling_default_of_the_wrong_kind_is_refused_naming_it(tmp_path, key, value):
    (tmp_path / "generation_config.json").write_text(json.dumps({key: value}))
    with pytest.raises(ConfigError, match=f"generation_config.json: {key} = "):
        generation_defaults(tmp_path)


def test_a_folder_without_defaults_keeps_nothing(tmp_path):
    (tmp_path / "base").mkdir(), (tmp_path / "run").mkdir()
    assert keep_stop_ids(tmp_path / "base", tmp_path / "run") is None and generation_defaults(tmp_path / "run") == {}
