"""The API key check (engine/api_server/auth.py): which routes it guards, what it accepts, where the key comes from."""

from __future__ import annotations

import pytest

from wcache import errors
from wcache.engine.api_server.auth import ApiKeys, from_flag_or_env

KEY = "sk-test-0123456789"


@pytest.mark.parametrize("header,why", [
    (None, errors.API_KEY_MISSING), ("", errors.API_KEY_MISSING), ("Bearer", errors.API_KEY_MISSING),
    ("Basic " + KEY, errors.API_KEY_MISSING), ("Bearer wrong", errors.API_KEY_WRONG),
    ("Bearer " + KEY + "x", errors.API_KEY_WRONG), ("Bearer " + KEY[:-1], errors.API_KEY_WRONG),
    ("Bearer " + KEY, None), ("bearer " + KEY, None),
])
def test_v1_routes_need_the_key(header, why):
    assert ApiKeys([KEY]).refusal("/v1/completions", header) == why
    assert ApiKeys([KEY]).refusal("/v1/models/x", header) == why


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/v1x"])
def test_other_routes_stay_open_as_in_vllm(path):
    assert ApiKeys([KEY]).refusal(path, None) is None


def test_any_of_several_keys_and_no_key_is_an_open_server():
    keys = ApiKeys([KEY, "second"])
    assert keys.refusal("/v1/models", "Bearer second") is None and keys.refusal("/v1/models", "Bearer " + KEY) is None
    assert not ApiKeys() and ApiKeys().refusal("/v1/models", None) is None


def test_the_key_is_kept_only_as_a_digest():
    keys = ApiKeys([KEY])
    assert KEY not in repr(keys) and KEY not in repr(vars(keys))


def test_the_flag_wins_and_an_empty_variable_is_unset():
    env = {"VLLM_API_KEY": "from-env"}
    assert from_flag_or_env([KEY], env).refusal("/v1/models", "Bearer " + KEY) is None
    assert from_flag_or_env([KEY], env).refusal("/v1/models", "Bearer from-env") == errors.API_KEY_WRONG
    assert from_flag_or_env(None, env).refusal("/v1/models", "Bearer from-env") is None
    assert not from_flag_or_env(None, {"VLLM_API_KEY": ""}) and not from_flag_or_env(None, {})


def test_an_empty_flag_is_refused():
    with pytest.raises(errors.UserError, match="--api-key must not be empty"):
        from_flag_or_env([""], {})
