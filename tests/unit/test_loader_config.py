"""`--model-loader-extra-config`: upstream's keys and defaults; unknown keys and bad values refused."""

from __future__ import annotations

import pytest

from wcache.errors import LoaderConfigError
from wcache.engine.loading.config import LOADER_KEYS, LoaderConfig, parse_loader_config

# Upstream's table (shared/reference/upstream-behaviour.md, "Loader keys").
UPSTREAM = {"mode": "zero_copy", "fallback": True, "socket_dir": None, "socket_path": None,
            "connect_timeout_s": 5.0, "state_timeout_s": 300.0}


# wcache's one addition to upstream's keys: which GPU transport the engine requires.
OWN = {"transport": "auto"}


def test_keys_and_defaults_equal_upstreams_table():
    assert LOADER_KEYS == {**UPSTREAM, **OWN}
    for value in (None, "", "{}", {}):
        assert parse_loader_config(value) == LoaderConfig(**UPSTREAM)


def test_every_key_is_accepted_and_parsed():
    lc = parse_loader_config('{"mode": "copy", "fallback": false, "socket_dir": "/run/wc", '
                             '"socket_path": "/run/wc/x.sock", "connect_timeout_s": 2, "state_timeout_s": 0.5}')
    assert lc == LoaderConfig("copy", False, "/run/wc", "/run/wc/x.sock", 2.0, 0.5)
    assert isinstance(lc.connect_timeout_s, float)
    assert parse_loader_config({"mode": "zero_copy", "fallback": True}).mode == "zero_copy"


BAD = [
    ('{"mode": "zero_copy",', "--model-loader-extra-config is not valid JSON: "),
    ("[1]", "--model-loader-extra-config must be a JSON object"),
    ('"zero_copy"', "--model-loader-extra-config must be a JSON object"),
    ('{"modes": "copy"}', "Unknown ipc_cache loader key(s) ['modes']; valid keys: ['connect_timeout_s', "
                          "'fallback', 'mode', 'socket_dir', 'socket_path', 'state_timeout_s', 'transport']"),
    ('{"b": 1, "a": 2, "mode": "copy"}', "Unknown ipc_cache loader key(s) ['a', 'b']; valid keys: "),
    ('{"mode": "fast"}', "mode must be one of ['zero_copy', 'copy'], got 'fast'"),
    ('{"transport": "nvlink"}', "transport must be one of ['auto', 'cuda_ipc', 'vmm_fd'], got 'nvlink'"),
    ('{"mode": null}', "mode must be one of ['zero_copy', 'copy'], got None"),
    ('{"fallback": "false"}', "fallback must be true or false, got 'false'"),
    ('{"fallback": 0}', "fallback must be true or false, got 0"),
    ('{"socket_dir": ""}', "socket_dir must be a non-empty string path, got ''"),
    ('{"socket_dir": 5}', "socket_dir must be a non-empty string path, got 5"),
    ('{"socket_path": ["/a"]}', "socket_path must be a non-empty string path, got ['/a']"),
    ('{"connect_timeout_s": 0}', "connect_timeout_s must be a positive number of seconds (at most 1e+06), got 0"),
    ('{"connect_timeout_s": -1.5}', "connect_timeout_s must be a positive number of seconds (at most 1e+06), got -1.5"),
    ('{"connect_timeout_s": "5"}', "connect_timeout_s must be a positive number of seconds (at most 1e+06), got '5'"),
    ('{"connect_timeout_s": true}', "connect_timeout_s must be a positive number of seconds (at most 1e+06), got True"),
    ('{"state_timeout_s": NaN}', "state_timeout_s must be a positive number of seconds (at most 1e+06), got nan"),
    ('{"state_timeout_s": Infinity}', "state_timeout_s must be a positive number of seconds (at most 1e+06), got inf"),
    ('{"state_timeout_s": 1e10}', "state_timeout_s must be a positive number of seconds (at most 1e+06), got 10000000000.0"),
    ('{"state_timeout_s": null}', "state_timeout_s must be a positive number of seconds (at most 1e+06), got None"),
]


@pytest.mark.parametrize("value,message", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_rejected_with_their_message(value, message):
    with pytest.raises(LoaderConfigError) as err:
        parse_loader_config(value)
    assert str(err.value).startswith(message)
