"""Rank planning and its validation (wcache.core.ranks), parsed from the real command line; and greedy
draft-then-verify decoding in one process (wcache.engine.worker.runner), which must give the target's greedy
output whatever the draft proposes."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from wcache.core import ranks, speculative
import prompt_ids as tokenizer
from wcache.core.checkpoint import make_checkpoint
from wcache.core.checkpoint_files import shard_files
from wcache.cli import build_parser, main
from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
from wcache.engine.loading.config import parse_loader_config
from wcache.model.llama import bind_weights, build_meta_model, generate
from wcache.core.ranks import ParallelSettings
from wcache.core.settings import from_flags
from wcache.engine.core.engine import rank_specs
from wcache.engine.core.settings import EngineSettings
from wcache.engine.worker.runner import RankRunner

TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 512}
WIDE = {"num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 8, "vocab_size": 512}


def preload_args(*flags: str):
    return build_parser().parse_args(["preload", "--model", "m", *flags])


def layout(*flags: str, hf: dict = WIDE) -> ranks.RankLayout:
    return ranks.plan_layout(from_flags(ParallelSettings, preload_args(*flags)), hf)


def triples(lay: ranks.RankLayout) -> list[tuple[int, int, int, int, int]]:
    """(global rank, dp, pp, tp, local rank) of every rank the node serves."""
    return [(r.global_rank, r.dp_rank, r.pp_rank, r.tp_rank, r.local_rank) for r in lay.local_ranks()]


def test_global_rank_enumerates_dp_then_pp_then_tp():
    lay = layout("-tp", "2", "-pp", "2", "-dp", "2")
    assert lay.world_size == 8 and not lay.spans_nodes
    got = triples(lay)
    assert [g for g, *_ in got] == list(range(8))
    for g, dp, pp, tp, local in got:
        assert g == dp * 2 * 2 + pp * 2 + tp == local


def test_nodes_serve_contiguous_blocks_with_local_ranks_from_zero():
    # Upstream's multi-node TP: local GPU i on node r is TP rank r * (tp / nnodes) + i.
    for node in range(2):
        got = triples(layout("-tp", "4", "--nnodes", "2", "--node-rank", str(node)))
        assert got == [(node * 2 + i, 0, 0, node * 2 + i, i) for i in range(2)]


def test_data_parallel_placement_per_node():
    # Upstream's DP: local GPU i serves DP rank start + i // tp and TP rank i % tp.
    got = triples(layout("-tp", "2", "-dp", "4", "--data-parallel-size-local", "2",
                         "--data-parallel-start-rank", "2"))
    assert got == [(4 + i, 2 + i // 2, 0, i % 2, i) for i in range(4)]
    # Without the local flags, --nnodes splits the DP ranks evenly.
    assert triples(layout("-dp", "4", "--nnodes", "2", "--node-rank", "1")) == [(2, 2, 0, 0, 0), (3, 3, 0, 0, 1)]


def test_engine_plan_picks_its_data_parallel_rank_and_driver():
    args = build_parser().parse_args(["serve", "m", "-dp", "2", "-tp", "2", "--data-parallel-rank", "1"])
    plan = ranks.plan_engine(from_flags(ParallelSettings, args), TINY, "cpu")
    assert [(r.dp_rank, r.tp_rank, r.local_rank) for r in plan.local] == [(1, 0, 2), (1, 1, 3)]
    assert plan.drives and plan.world_size == 2
    follower = build_parser().parse_args(["serve", "m", "-tp", "2", "--nnodes", "2", "--node-rank", "1"])
    plan = ranks.plan_engine(from_flags(ParallelSettings, follower), TINY, "cpu")
    assert not plan.drives and [r.tp_rank for r in plan.local] == [1]


E = ranks.ParallelConfigError


@pytest.mark.parametrize("flags, message", [
    (["-tp", "3"], ranks.HEADS_NOT_DIVISIBLE.format(heads=4, tp=3)),
    (["-tp", "4"], ranks.KV_HEADS_NOT_DIVISIBLE.format(kv=2, tp=4)),
    (["-pp", "5"], ranks.PP_TOO_LARGE.format(pp=5, layers=4)),
    (["-tp", "0"], ranks.AT_LEAST_ONE.format(flag="--tensor-parallel-size", value=0)),
    (["--nnodes", "2", "--node-rank", "2"], ranks.NODE_RANK_RANGE.format(last=1, nnodes=2, value=2)),
    (["-tp", "2", "-pp", "1", "--nnodes", "4"], ranks.WORLD_NOT_DIVISIBLE.format(world=2, nnodes=4)),
    (["--data-parallel-size-local", "2"], ranks.DP_FLAGS_WITHOUT_DP),
    (["-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "3"],
     ranks.DP_RANGE.format(end=5, dp=4)),
])
def test_layout_errors(flags, message):
    with pytest.raises(E) as e:
        layout(*flags, hf=TINY)
    assert str(e.value) == message


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ranks-unit") / "tiny32", "tiny", dtype="float32")


def plan_error(model, *flags: str) -> str:
    args = build_parser().parse_args(["preload", "--model", str(model), "--device", "cpu", *flags])
    cfg = EngineConfig.build(args.model, device="cpu")
    with pytest.raises(E) as e:
        ranks.plan_daemons(from_flags(ParallelSettings, args), cfg)
    return str(e.value)


def test_daemon_port_errors(model32):
    spans = ["-tp", "2", "--nnodes", "2"]
    assert plan_error(model32, *spans) == ranks.MASTER_PORT_REQUIRED
    assert plan_error(model32, "--weight-cache-master-port", "29501") == ranks.MASTER_PORT_CLASH.format(port=29501)
    assert plan_error(model32, "--master-port", "29700", "--weight-cache-master-port", "29700") == \
        ranks.MASTER_PORT_CLASH.format(port=29700)
    draft = json.dumps({"method": "eagle", "model": str(model32), "num_speculative_tokens": 2})
    assert plan_error(model32, "--speculative-config", draft, "--weight-cache-master-port", "29600",
                      "--weight-cache-draft-master-port", "29600") == ranks.DRAFT_PORT_CLASH


def test_daemon_plan_groups_and_ports(model32):
    spec = json.dumps({"method": "eagle", "model": str(model32), "num_speculative_tokens": 2})
    args = build_parser().parse_args(["preload", "--model", str(model32), "-tp", "2", "--nnodes", "2",
                                      "--node-rank", "1", "--master-addr", "10.0.0.1",
                                      "--weight-cache-master-port", "29600", "--speculative-config", spec])
    plan = ranks.plan_daemons(from_flags(ParallelSettings, args), EngineConfig.build(args.model, device="cpu"))
    target, draft = plan.groups
    assert target == {"draft": False, "world": {"init_method": "tcp://10.0.0.1:29600", "world_size": 2,
                                                "backend": "gloo"}}
    # Across nodes the draft group's port defaults to the target's + 1, the same on every node.
    assert draft["draft"] and draft["world"]["init_method"] == "tcp://10.0.0.1:29601"
    assert draft["model"] == str(model32)
    not_cached = json.dumps({"method": "draft_model", "model": str(model32), "num_speculative_tokens": 2})
    args = build_parser().parse_args(["preload", "--model", str(model32), "--speculative-config", not_cached])
    plan = ranks.plan_daemons(from_flags(ParallelSettings, args), EngineConfig.build(args.model, device="cpu"))
    assert len(plan.groups) == 1


@pytest.mark.parametrize("value, message", [
    ("{", None),
    ("[1]", speculative.SPEC_OBJECT),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 1, "extra": 1}',
     speculative.SPEC_UNKNOWN.format(keys=["extra"], valid=list(speculative.SPEC_KEYS))),
    ('{"method": "ngram", "num_speculative_tokens": 1}',
     speculative.SPEC_METHOD.format(methods=list(speculative.DRAFT_METHODS), method="ngram")),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 0}', speculative.SPEC_TOKENS.format(value=0)),
    ('{"method": "eagle", "num_speculative_tokens": 2}', speculative.SPEC_MODEL.format(error="missing")),
    ('{"method": "eagle", "model": "/nonexistent", "num_speculative_tokens": 2}',
     speculative.SPEC_MODEL.format(error="no config.json in /nonexistent")),
])
def test_speculative_config_errors(value, message):
    with pytest.raises(E) as e:
        speculative.parse_speculative_config(value)
    if message is None:
        assert str(e.value).startswith("--speculative-config is not valid JSON: ")
    else:
        assert str(e.value) == message


def test_draft_must_fit_the_target(model32, tmp_path):
    spec = speculative.SpecConfig("eagle", str(model32), 2)
    with pytest.raises(E) as e:
        ranks.check_draft(spec, TINY, tp=1, pp=2)
    assert str(e.value) == ranks.SPEC_PP
    with pytest.raises(E) as e:
        ranks.check_draft(spec, {**TINY, "vocab_size": 1000}, tp=1, pp=1)
    assert str(e.value) == ranks.SPEC_VOCAB.format(draft=512, target=1000)


def test_serve_errors(model32):
    args = build_parser().parse_args(["serve", str(model32), "-dp", "2"])
    with pytest.raises(E) as e:
        ranks.plan_engine(from_flags(ParallelSettings, args), TINY, "cpu")
    assert str(e.value) == ranks.DP_RANK_REQUIRED.format(last=1)
    args = build_parser().parse_args(["serve", str(model32), "-dp", "2", "--data-parallel-rank", "2"])
    with pytest.raises(E) as e:
        ranks.plan_engine(from_flags(ParallelSettings, args), TINY, "cpu")
    assert str(e.value) == ranks.DP_RANK_RANGE.format(last=1, value=2)
    args = build_parser().parse_args(["serve", str(model32), "-dp", "4", "--data-parallel-size-local", "2",
                                      "--data-parallel-rank", "3"])
    with pytest.raises(E) as e:
        ranks.plan_engine(from_flags(ParallelSettings, args), TINY, "cpu")
    assert str(e.value) == ranks.DP_RANK_NOT_LOCAL.format(rank=3, node=0, lo=0, hi=1)
    spec = json.dumps({"method": "eagle", "model": str(model32), "num_speculative_tokens": 2})
    args = build_parser().parse_args(["serve", str(model32), "--speculative-config", spec, "--load-format",
                                      "ipc_cache"])
    with pytest.raises(E) as e:
        rank_specs(from_flags(EngineSettings, args), parse_loader_config({"socket_path": "/tmp/x.sock"}))
    assert str(e.value) == ranks.SPEC_SOCKET_PATH.format(methods="eagle, eagle3, mtp")


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], _ = saved
    root.setLevel(saved[1])


def test_cli_reports_a_layout_error_and_exits_2(model32, capsys, restore_logging):
    # The whole `wcache preload` path up to the check: nothing is started, the message is printed.
    code = main(["preload", "--model", str(model32), "--device", "cpu", "-tp", "2", "--nnodes", "2"])
    assert code == 2
    assert ranks.MASTER_PORT_REQUIRED in capsys.readouterr().err


# -- speculative decoding, one process --------------------------------------------------------
def partial_draft(model_dir, out_dir):
    """The target with its last MLP zeroed: it agrees with the target on some tokens, not all."""
    out_dir.mkdir()
    for f in shard_files(model_dir):
        tensors = load_file(str(f))
        for name in tensors:
            if name == "model.layers.3.mlp.down_proj.weight":
                tensors[name] = torch.zeros_like(tensors[name])
        save_file(tensors, str(out_dir / f.name), metadata={"format": "pt"})
    for name in ("config.json", "model.safetensors.index.json"):
        if (model_dir / name).exists():
            (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


def test_speculative_decoding_equals_greedy(model32, tmp_path):
    cfg = EngineConfig.build(str(model32), device="cpu")
    target = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), load_processed(cfg, False).bindable())
    drafts = {"same": str(model32), "partial": str(partial_draft(model32, tmp_path / "partial")),
              "other": str(make_checkpoint(tmp_path / "other", "tiny", seed=1, dtype="float32"))}
    rates = {}
    for label, k in (("same", 3), ("partial", 1), ("partial", 3), ("other", 3)):
        spec = json.dumps({"method": "eagle", "model": drafts[label], "num_speculative_tokens": k})
        args = build_parser().parse_args(["serve", str(model32), "--device", "cpu", "--no-enable-autotune",
                                          "--speculative-config", spec])
        _, specs = rank_specs(from_flags(EngineSettings, args), parse_loader_config(None))
        runner = RankRunner.from_spec(specs[0])
        runner.start()
        ids = tokenizer.encode("The weight cache keeps")
        assert runner.decode(ids, 16, tokenizer.EOS_ID) == generate(target, ids, 16, tokenizer.EOS_ID)
        rates[label, k] = runner.accepted / runner.proposed
    # Every path of the verification ran: all accepted, some accepted, (almost) none accepted.
    assert rates["same", 3] == 1.0
    assert 0.0 < rates["partial", 1] < 1.0 and 0.0 < rates["partial", 3] < 1.0
    assert rates["other", 3] < rates["partial", 3]
