from procs import complete


def test_cache_roundtrip_matches_disk(procs, tiny_model):
    disk = procs.serve(tiny_model)
    expected = complete(disk.port)["choices"][0]["token_ids"]
    disk.stop()
    procs.preload(tiny_model)
    cached = procs.serve(tiny_model, "--load-format", "ipc_cache")
    assert "Mapped 27 tensors from the weight cache daemon (zero_copy mode)" in cached.log()
    assert complete(cached.port)["choices"][0]["token_ids"] == expected
